"""An op-level bench row as named fields, and its JSON form: one flat object per row whose keys name
the check, side and boundary (``bound_err_rewy``, ``baseline_B_ms``, ...). ``to_json`` spells them;
dev/bench_lab/rows.py reads kept files back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..op_inputs import Shape


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


@dataclass
class Timing:
    """One side's figures: per boundary the median of its timed rounds and the rounds; its peak
    memory (CUDA), and the first error it met."""
    ms: dict[str, float | None] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)
    peak_mb: float | None = None
    error: str | None = None

    def fail(self, why: str) -> None:
        """Keep the first error: a later one is usually its consequence."""
        self.error = self.error or why

    def to_json(self, side: str) -> dict:
        """``side``: "baseline_" or "rewy_" for a row's own sides, "" for a further side's own entry."""
        out = {}
        for bd, ms in self.ms.items():
            out.update({f"{side}{bd}_ms": ms, f"{side}{bd}_rounds": self.rounds.get(bd, [])})
        return out | _present(((side + "peak_mb", self.peak_mb), (side + "error", self.error)))


# The second checks some ops get, by their key prefix: gates near the safe lower bound, strong decay.
SECOND_CHECKS = ("bound", "strong")


@dataclass
class OpRow:
    """One configuration of the op bench. ``check`` is None where the reference itself failed (then
    ``rewy.error`` says how); ``ok`` is the row's verdict, every check's together; ``more``: the keys
    a caller adds to the row's JSON (``op_bench.Extra``), written as they are."""
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
    seconds: float | None = None
    more: dict = field(default_factory=dict)

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
        return out | _present((k, getattr(self, k)) for k in ("baseline_hint", "seconds")) | self.more


def as_json(data: dict) -> dict:
    """A run's document with its rows (``OpRow``, or any row with ``to_json``) in their JSON form."""
    if not data.get("rows") or isinstance(data["rows"][0], dict):
        return data
    return {**data, "rows": [r.to_json() for r in data["rows"]]}
