"""The developer bench's command line: the installed `rewy-hf bench` parser with the developer options
added, and the dispatch to the installed bench or to this package's modules."""

from __future__ import annotations

import argparse
import sys
import warnings

from rewy_hf.bench.config import given
from rewy_hf.cli import bench
from rewy_hf.cli.options import HelpFormatter, JsonReport

from . import context_parallel, reports
from .op_level import run_lab_ops
from .peers import PEERS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python $REPO/dev/bench_lab", formatter_class=HelpFormatter,
                                     description=f"{bench.HELP}; with the developer options below")
    bench.add_arguments(parser)
    lab = parser.add_argument_group("developer options (not in the installed rewy-hf bench)")
    lab.add_argument("--peers", nargs="+", action="extend", choices=(*PEERS, "all"), default=None,
                     help="CUDA: also time these baselines beside FLA as installed, alternating with it and rewy "
                          "on the same inputs, each gradient-checked: fla-triton (FLA with its backend dispatch "
                          "off, so no FlashQLA or TileLang kernels: what FLA_DISABLE_BACKEND_DISPATCH=1 gives), "
                          "flash-qla (FlashQLA's own entry, GDN only); all: both. A peer that does not apply here "
                          "(not installed, another op) is listed with the reason")
    lab.add_argument("--kernel-profile", action="store_true",
                     help="after each side's timing, profile one more of its runs with torch.profiler and list "
                          "where its time goes: device time and launches per kernel on CUDA (per ATen operator, "
                          "self time, on CPU), beside the other sides', per configuration and boundary")
    lab.add_argument("--context-parallel", action="store_true",
                     help="launched as N processes (torchrun --nproc-per-node N $REPO/dev/bench_lab ...; one GPU "
                          "each, gloo on CPU): each --shapes row (B = 1, T divisible by N) is split across them "
                          "with FLA's cp_context, and rewy's op is timed against FLA's on every slice (gdn, kda, "
                          "gdn2); a round's time is the slowest process's")
    lab.add_argument("--markdown", default=None, metavar="OUT.md",
                     help="also write the tables as Markdown (for docs/); works with --from-json")
    lab.add_argument("--from-json", nargs="+", default=None, metavar="RUN.json",
                     help="run nothing: print the tables of an earlier run's --json (and draw --plot from it); "
                          "exits with its status. Several op-level files of one setup are combined into one "
                          "report, and model-level runs of some --sides each (on the same settings) into one table")
    return parser


class KeptReport(JsonReport):
    """The --json report, its final document also kept (for ``reports.write_outputs``)."""
    data: dict | None = None

    def finish(self, data: dict) -> None:
        self.data = data
        super().finish(data)


def refusal(args) -> str | None:
    """Why a run with these options cannot start, with the fix; None when it can."""
    if args.context_parallel:
        return context_parallel.refusal(args)
    if args.model and (taken := given(args, "--peers", "--kernel-profile")):
        return f"{', '.join(taken)} apply to the op-level bench; drop them, or drop --model"
    return None


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
    args = build_parser().parse_args(argv)
    if args.from_json:
        return reports.render(args)
    if (reason := refusal(args)) is not None:
        print(f"bench_lab: {reason}", file=sys.stderr)
        return 2
    report = KeptReport(args.json)
    level = context_parallel.run_cp if args.context_parallel else None if args.model else run_lab_ops
    code = bench.run(args, report, level=level)
    if code != 2 and report.data is not None:
        reports.write_outputs(args, report.data, sys.stderr if report.to_stdout else None)
    return code
