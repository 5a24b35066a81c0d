"""``--peers``: further baselines timed beside FLA as installed, alternating with it and rewy on the same
inputs, each gradient-checked: ``fla-triton`` (FLA with its backend dispatch off, so no FlashQLA or
TileLang kernels: what ``FLA_DISABLE_BACKEND_DISPATCH=1`` gives) and ``flash-qla`` (FlashQLA's own
entry, GDN only). A peer that does not apply here is listed with the reason. Each row keeps its peers
under "peers" in its JSON."""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field, fields
from typing import Iterator

from rewy_hf.bench.fla_backends import active_backends, registries
from rewy_hf.bench.op_bench import (GUARD_NOTE, Impl, ShapeContext, fla_impl, grad_errors, guard_lifted, packed,
                                    served_grads)
from rewy_hf.bench.rows import OpRow, Timing
from rewy_hf.bench.tables import cell, geomean, ms_cell, shape_label, speedup_cell, table, titled
from rewy_hf.bench.timing import describe

from .rows import speedups_of, timing_of

PEERS = ("fla-triton", "flash-qla")
PEER_TEXT = {"fla-triton": "FLA's Triton path (its backend dispatch off: FlashQLA and TileLang not used)",
             "flash-qla": "FlashQLA's own entry (flash_qla.chunk_gated_delta_rule)"}


@contextlib.contextmanager
def dispatch_off() -> Iterator[None]:
    """FLA's Triton path: no registry of FLA's backends (rewy_hf/bench/fla_backends.py) offers one inside
    this block, which is what ``FLA_DISABLE_BACKEND_DISPATCH=1`` gives a process started with it."""
    saved = [(reg, reg._backends) for reg in registries()]
    for reg, _ in saved:
        reg._backends = {}
    try:
        yield
    finally:
        for reg, backends in saved:
            reg._backends = backends


@dataclass
class Peer:
    """A further baseline in one row: why it does not apply here, or its check, times and (with
    --kernel-profile) kernels per boundary."""
    skipped: str | None = None
    policy: str | None = None
    timing_only: bool = False
    note: str = ""
    served_by: list[str] | None = None
    err: float | None = None
    err_per_grad: dict | None = None
    timing: Timing = field(default_factory=Timing)
    speedup: dict[str, float | None] = field(default_factory=dict)
    kernels: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        out = {"policy": self.policy, "timing_only": self.timing_only, "note": self.note}
        out |= {k: getattr(self, k) for k in ("served_by", "err", "err_per_grad") if getattr(self, k) is not None}
        out |= self.timing.to_json("") | {f"kernels_{bd}": k for bd, k in self.kernels.items()}
        return out | {f"speedup_{bd}": x for bd, x in self.speedup.items()}

    @classmethod
    def from_json(cls, d: dict) -> "Peer":
        nested = ("timing", "speedup", "kernels")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name not in nested and f.name in d},
                   timing=timing_of(d, ""), speedup=speedups_of(d),
                   kernels={k.removeprefix("kernels_"): v for k, v in d.items() if k.startswith("kernels_")})


def peers_of(row: OpRow) -> dict[str, Peer]:
    """The peers a row holds (none where the run timed none)."""
    return {name: Peer.from_json(p) for name, p in (row.more.get("peers") or {}).items()}


def peer_impl(op: str, name: str, policy: str, gdn_guard: dict, device: str) -> Impl | str:
    """The peer side ``name`` of ``op``, or why it does not apply on this machine."""
    if device != "cuda":
        return "peers are FLA's and FlashQLA's GPU kernels; a CPU run has none"
    if name == "fla-triton":
        if not active_backends():
            return "no FLA backend is on here: FLA as installed already is its Triton path"
        impl = fla_impl(op, policy, gdn_guard)
        impl.scope = dispatch_off
        if guard_lifted(op, gdn_guard):         # with the dispatch off, no backend serves the guarded kernel
            impl.trusted, impl.note = False, GUARD_NOTE
        return impl
    if name == "flash-qla":
        if op != "gdn":
            return "FlashQLA has Gated DeltaNet only"
        if importlib.util.find_spec("flash_qla") is None:
            return "flash-qla is not installed"
        import flash_qla

        return Impl(lambda *x, **packing: flash_qla.chunk_gated_delta_rule(*x, **packing)[0],
                    "saves A and the gate cumsum, recomputes states")
    raise ValueError(f"unknown peer {name!r}; expected one of {PEERS}")


def check_peers(ctx: ShapeContext, names: tuple[str, ...],
                policy: str) -> tuple[dict[str, Peer], dict[str, Impl]]:
    """Each peer's gradient check; (every peer asked for, the impls of those that will be timed)."""
    peers: dict[str, Peer] = {}
    timed: dict[str, Impl] = {}
    for name in names:
        made = peer_impl(ctx.op, name, policy, ctx.s.gdn_guard, ctx.s.device)
        if isinstance(made, str):
            peers[name] = Peer(skipped=made)
            continue
        peer = peers[name] = Peer(policy=made.policy, timing_only=not made.trusted, note=made.note)
        try:
            got, peer.served_by = served_grads(packed(made, ctx.check_packing), ctx.check_inputs, ctx.check_do)
            if made.trusted:
                per = grad_errors(ctx.op, got, ctx.ref)
                peer.err, peer.err_per_grad = max(per.values()), per
        except Exception as exc:
            peer.timing.fail(describe(exc))
            continue
        timed[name] = made
    return peers, timed


def format_peer_table(rows: list[OpRow], boundaries: list[str], base: str, markdown: bool = False) -> str:
    """The peers of one (op, policy) beside FLA as installed and rewy: per shape and peer its time, rewy's
    speedup over it, its peak memory, its gradient error and the FLA backends that served it."""
    r0 = rows[0]
    peers = {id(r): peers_of(r) for r in rows}
    names = list(dict.fromkeys(n for r in rows for n in peers[id(r)]))
    header = ["B,T,H", "peer"] + [c for bd in boundaries for c in (f"{bd}: peer ms", f"{bd}: rewy ms",
                                                                     f"{bd}: rewy speedup")]
    header += ["peak MB peer", "err peer", "served by"]
    body, notes = [], []
    for r in rows:
        for n in names:
            p = peers[id(r)].get(n)
            if p is None:
                continue
            cells = [shape_label(r), n]
            if p.skipped is not None:
                body.append(cells + ["-"] * (len(header) - 2))
                if p.skipped not in notes:
                    notes.append(f"{n}: not timed: {p.skipped}")
                continue
            for bd in boundaries:
                cells += [ms_cell(p.timing.ms.get(bd)), ms_cell(r.rewy.ms.get(bd)), speedup_cell(p.speedup.get(bd))]
            err = "timing only" if p.timing_only else cell(p.err, ".1e")
            body.append(cells + [cell(p.timing.peak_mb, ".0f"), err, ", ".join(p.served_by or []) or
                                 "its own kernels"])
            if p.timing.error:
                notes.append(f"{shape_label(r)} {n}: {p.timing.error}")
    for n in names:
        timed = [p for r in rows if (p := peers[id(r)].get(n)) is not None and p.skipped is None]
        if timed:
            gm = ["geometric mean", n]
            for bd in boundaries:
                gm += ["", "", speedup_cell(geomean([p.speedup.get(bd) for p in timed]))]
            body.append(gm + [""] * (len(header) - len(gm)))
    served = sorted({x for r in rows for x in ((r.check and r.check.baseline_served_by) or [])})
    title = (f"{r0.op}, rewy policy {r0.policy}: peers beside {base} "
             f"({base} as installed was served by: {', '.join(served) or 'its own Triton kernels'})")
    notes += [f"{n}: {PEER_TEXT.get(n, n)}" for n in names]
    return titled(title, table(header, body, markdown), notes, markdown)   # notes: one per peer at least


def peer_line(row: OpRow, boundaries: list[str]) -> str:
    """The peers' part of the line printed as a row finishes."""
    parts = []
    for name, p in peers_of(row).items():
        if p.skipped is None:
            times = ", ".join(f"{bd} {ms_cell(p.timing.ms.get(bd))} ms ({speedup_cell(p.speedup.get(bd))})"
                              for bd in boundaries)
            parts.append(f"; {name} {times}, err {'timing only' if p.timing_only else cell(p.err, '.1e')}")
    return "".join(parts)
