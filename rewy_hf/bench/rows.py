"""An op-level bench row as named fields, and its JSON form: one flat object per row whose keys name
the check, side and boundary (``bound_err_rewy``, ``baseline_B_ms``, ``rewy_kernels_FB``, ...).
``to_json`` and ``from_json`` are the only places that spell them, so earlier files keep loading."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..op_inputs import Shape
from .config import BOUNDARIES


def _present(pairs) -> dict:
    return {k: v for k, v in pairs if v is not None}


# Written even when None: a reader sees that a side's error was not computed, not that the field is missing.
_ALWAYS = ("err_baseline", "err_baseline_per_grad", "err_rewy", "err_rewy_per_grad", "ok", "check_rule")


@dataclass
class Check:
    """One gradient check: each side's relative error against the reference (the worst gradient's and
    each gradient's), and the verdict under ``check_rule``."""
    err_baseline: float | None = None
    err_baseline_per_grad: dict | None = None
    err_rewy: float | None = None
    err_rewy_per_grad: dict | None = None
    ok: bool = False
    check_rule: str = ""
    rewy_backend: str | None = None
    rewy_error: str | None = None
    baseline_served_by: list[str] | None = None
    baseline_check_error: str | None = None

    def to_json(self, prefix: str = "") -> dict:
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None or f.name in _ALWAYS}

    @classmethod
    def from_json(cls, d: dict, prefix: str = "") -> "Check":
        return cls(**{f.name: d[prefix + f.name] for f in fields(cls) if prefix + f.name in d})


@dataclass
class Timing:
    """One side's figures: per boundary the median of its timed rounds, the rounds and (with
    --kernel-profile) its kernels; its peak memory (CUDA), and the first error it met."""
    ms: dict[str, float | None] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)
    kernels: dict[str, dict] = field(default_factory=dict)
    peak_mb: float | None = None
    error: str | None = None

    def fail(self, why: str) -> None:
        """Keep the first error: a later one is usually its consequence."""
        self.error = self.error or why

    def to_json(self, side: str) -> dict:
        """``side``: "baseline_" or "rewy_" for a row's own sides, "" inside a peer's entry."""
        out = {}
        for bd, ms in self.ms.items():
            out.update({f"{side}{bd}_ms": ms, f"{side}{bd}_rounds": self.rounds.get(bd, [])})
        out.update({f"{side}kernels_{bd}": k for bd, k in self.kernels.items()})
        return out | _present(((side + "peak_mb", self.peak_mb), (side + "error", self.error)))

    @classmethod
    def from_json(cls, d: dict, side: str) -> "Timing":
        timed = [bd for bd in BOUNDARIES if f"{side}{bd}_ms" in d]
        return cls(ms={bd: d[f"{side}{bd}_ms"] for bd in timed},
                   rounds={bd: d.get(f"{side}{bd}_rounds") or [] for bd in timed},
                   kernels={bd: d[f"{side}kernels_{bd}"] for bd in BOUNDARIES if f"{side}kernels_{bd}" in d},
                   peak_mb=d.get(side + "peak_mb"), error=d.get(side + "error"))


def _speedups(d: dict) -> dict[str, float | None]:
    return {bd: d[f"speedup_{bd}"] for bd in BOUNDARIES if f"speedup_{bd}" in d}


@dataclass
class Peer:
    """A further baseline of --peers in one row: why it does not apply here, or its check and times."""
    skipped: str | None = None
    policy: str | None = None
    timing_only: bool = False
    note: str = ""
    served_by: list[str] | None = None
    err: float | None = None
    err_per_grad: dict | None = None
    timing: Timing = field(default_factory=Timing)
    speedup: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        out = {"policy": self.policy, "timing_only": self.timing_only, "note": self.note}
        out |= _present((k, getattr(self, k)) for k in ("served_by", "err", "err_per_grad"))
        return out | self.timing.to_json("") | {f"speedup_{bd}": x for bd, x in self.speedup.items()}

    @classmethod
    def from_json(cls, d: dict) -> "Peer":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name not in ("timing", "speedup") and f.name in d},
                   timing=Timing.from_json(d, ""), speedup=_speedups(d))


# The second checks some ops get, by their key prefix: gates near the safe lower bound, strong decay.
SECOND_CHECKS = ("bound", "strong")
# OpRow's fields that are not one JSON key of their own.
_NESTED = ("shape", "check", *SECOND_CHECKS, "baseline", "rewy", "speedup", "peers")


@dataclass
class OpRow:
    """One configuration of the op bench. ``check`` is None where the reference itself failed (then
    ``rewy.error`` says how); ``ok`` is the row's verdict, every check's together."""
    op: str
    policy: str
    shape: Shape
    check_T: int | None = None
    check_reduced: bool = False
    ok: bool = False
    check: Check | None = None
    bound: Check | None = None
    strong: Check | None = None
    baseline_policy: str | None = None
    baseline_timing_only: bool = False
    baseline_note: str = ""
    baseline_hint: str | None = None
    baseline: Timing = field(default_factory=Timing)
    rewy: Timing = field(default_factory=Timing)
    speedup: dict[str, float | None] = field(default_factory=dict)
    peers: dict[str, Peer] | None = None
    kernel_profile_errors: dict[str, dict[str, str]] | None = None
    autotune_picks: dict | None = None
    seconds: float | None = None
    source: str | None = None       # the file a row came from, in a report combined from several

    def second_checks(self) -> list[tuple[str, Check]]:
        return [(name, c) for name in SECOND_CHECKS if (c := getattr(self, name)) is not None]

    def to_json(self) -> dict:
        out = {"op": self.op, "policy": self.policy, **asdict(self.shape), "check_T": self.check_T,
               "check_reduced": self.check_reduced}
        if self.check is not None:
            out |= {"baseline_policy": self.baseline_policy, "baseline_timing_only": self.baseline_timing_only,
                    "baseline_note": self.baseline_note, **self.check.to_json()}
        for name, c in self.second_checks():
            out |= c.to_json(name + "_")
        out |= self.baseline.to_json("baseline_") | self.rewy.to_json("rewy_")
        out |= {f"speedup_{bd}": x for bd, x in self.speedup.items()} | {"ok": self.ok}
        out |= _present((k, getattr(self, k)) for k in ("baseline_hint", "kernel_profile_errors",
                                                         "autotune_picks", "seconds", "source"))
        if self.peers is not None:
            out["peers"] = {name: p.to_json() for name, p in self.peers.items()}
        return out

    @classmethod
    def from_json(cls, d: dict) -> "OpRow":
        shape = Shape(d["B"], d["T"], d["H"], d["K"], d["V"], d.get("N", 0))
        row = cls(**{f.name: d[f.name] for f in fields(cls) if f.name not in _NESTED and f.name in d},
                  shape=shape, baseline=Timing.from_json(d, "baseline_"), rewy=Timing.from_json(d, "rewy_"),
                  speedup=_speedups(d))
        row.check = Check.from_json(d) if "check_rule" in d or "err_rewy" in d else None
        for name in SECOND_CHECKS:
            if f"{name}_ok" in d:
                setattr(row, name, Check.from_json(d, name + "_"))
        if "peers" in d:
            row.peers = {name: Peer.from_json(p) for name, p in (d["peers"] or {}).items()}
        return row


def as_json(data: dict) -> dict:
    """A run's document with its rows (``OpRow``, or any row with ``to_json``) in their JSON form."""
    if not data.get("rows") or isinstance(data["rows"][0], dict):
        return data
    return {**data, "rows": [r.to_json() for r in data["rows"]]}
