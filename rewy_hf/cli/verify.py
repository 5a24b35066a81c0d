"""`rewy-hf verify`: a short self-check of a fresh install.

Three groups of checks, each a row of the table: the environment, every op
against the float64 recurrence (and, on CUDA, the Triton backend against the
fp32 torch backend), and every adapter family on its tiny preset; see
``rewy_hf.verify.checklist``. Exit code 0 when every row passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from .options import NO_CUDA, JsonReport, add_json, chosen_device

HELP = "self-check of a fresh install: environment, each op, each adapter family (exit 0 = all pass)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..verify.checklist import GROUPS

    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where to run the checks (default: cuda if available, else cpu)")
    parser.add_argument("--only", choices=GROUPS, action="append",
                        help="run only these groups (repeatable; default: all of them)")
    add_json(parser, "the table")


def run(args: argparse.Namespace) -> int:
    from ..cpu_triton import enable_cpu_interpreter, first_config_only
    from ..verify.checklist import GROUPS, run_checks

    device = chosen_device(args.device)
    if device is None:
        print(f"rewy-hf verify: {NO_CUDA}", file=sys.stderr)
        return 2
    if device == "cpu":
        enable_cpu_interpreter()
    elif "fla" not in sys.modules:
        first_config_only()
    report = JsonReport(args.json)
    with report.human_output():
        rows = run_checks(args.only or list(GROUPS), device, on_row=lambda r: print(
            f"{'PASS' if r['ok'] else 'FAIL'}  {r['check']:<50} {r['detail']}", flush=True))
        failed = [r for r in rows if not r["ok"]]
        print(f"\nrewy-hf verify on {device}: {len(rows) - len(failed)} of {len(rows)} checks passed"
              + (f"; failed: {', '.join(r['check'] for r in failed)}" if failed else ""))
    report.finish({"device": device, "ok": not failed, "checks": rows})
    return 0 if not failed else 1
