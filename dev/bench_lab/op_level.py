"""The installed op level with this package's additions (``op_bench.Extra``): the peers each row
times beside FLA as installed (``peers``), each side's kernels (``kernels``), and on CUDA the autotune
picks each row ran with; their tables follow each (op, policy)'s own."""

from __future__ import annotations

from rewy_hf.bench.config import expand
from rewy_hf.bench.op_bench import Extra, ShapeContext, packed
from rewy_hf.bench.rows import OpRow
from rewy_hf.bench.runner import run_ops
from rewy_hf.bench.timing import free_memory

from .kernels import format_kernel_table, picks, profile_row, profiled_sides
from .peers import PEERS, check_peers, format_peer_table, peer_line, peers_of


def lab_tables(rows: list[OpRow], boundaries: list[str], base: str, device: str, markdown: bool = False) -> list[str]:
    """After one (op, policy)'s table: its peers' table where the run timed peers, and its kernel
    tables where it profiled them."""
    out = [format_peer_table(rows, boundaries, base, markdown=markdown)] if any(peers_of(r) for r in rows) else []
    return out + [format_kernel_table(r, bd, base, device, markdown=markdown) for r in rows for bd in boundaries
                  if profiled_sides(r, bd, base)]


class LabExtra(Extra):
    """--peers, --kernel-profile and the recorded autotune picks of one op-level run."""

    def __init__(self, args, device: str):
        self.peers = tuple(expand(args.peers, PEERS, "all", ()))
        self.profile, self.device = args.kernel_profile, device
        # the configs FLA's and rewy's kernels ran at a shape (kept across the policies of one shape, so a
        # later policy's row holds the earlier ones' too; a run that keeps them across shapes records none,
        # as they would mix shapes)
        self.record_picks = device == "cuda" and not args.keep_autotune_picks
        self.settings = {"peers": list(self.peers), "kernel_profile": self.profile}
        self.current = None     # the row being timed: (row, its context, its sides, its peers)

    def add_sides(self, ctx: ShapeContext, row: OpRow, sides: dict) -> None:
        peers, impls = check_peers(ctx, self.peers, row.policy)
        packing = ctx.shape.packing(ctx.s.device)
        sides.update({f"peer:{n}": (packed(impl, packing), peers[n].timing) for n, impl in impls.items()})
        self.current = (row, ctx, sides, peers)

    def after_row(self, row: OpRow, boundaries: list[str]) -> str:
        current, self.current = self.current, None
        if current is not None and current[0] is row:
            _, ctx, sides, peers = current
            for p in (peers[name.removeprefix("peer:")] for name in sides if name.startswith("peer:")):
                p.speedup = {bd: ms / r if (ms := p.timing.ms.get(bd)) and (r := row.rewy.ms.get(bd)) else None
                             for bd in boundaries}
            if self.profile:
                profile_row(row, sides, peers, boundaries, *ctx.timed_inputs(), self.device)
                free_memory(self.device)
            if self.peers:
                row.more["peers"] = {n: p.to_json() for n, p in peers.items()}
        if self.record_picks:
            row.more["autotune_picks"] = picks()
        return peer_line(row, boundaries)

    tables = staticmethod(lab_tables)


def run_lab_ops(args, device: str, guard: dict, report) -> int:
    """The op level of a developer bench run (a ``runner.run_bench`` level)."""
    return run_ops(args, device, guard, report, LabExtra(args, device))
