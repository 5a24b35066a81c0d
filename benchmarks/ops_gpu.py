"""FLA 0.6.0 vs rewy on the GPU, op level: now `rewy-hf bench` (rewy_hf/bench_command.py).

This script only translates its old options, which docs/performance.md still
quotes, and runs the command; everything it measured, and more, is there:

    python benchmarks/ops_gpu.py --ops gdn --lift-gdn-guard
      == rewy-hf bench --device cuda --op gdn --policy recompute --lift-gdn-guard

``--shapes`` takes indices into the suite (rewy_hf/bench_shapes.json); options
it does not know are passed through (e.g. ``--plot out.png --boundary B``).
The JSON it writes is the command's (settings, versions, rows), no longer a
bare list of rows.
"""

from __future__ import annotations

import argparse
import sys


def translate(argv: list[str] | None = None) -> list[str]:
    from rewy_hf.bench_config import suite_file

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=["gdn", "kda", "gdn2", "delta_rule"])
    p.add_argument("--shapes", nargs="+", type=int, default=None, help="indices into the suite (default: all)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--policy", default="recompute")
    p.add_argument("--check-shape", default=None,
                   help="ignored: every configuration is now checked at its own shape (see --check-max-tokens)")
    p.add_argument("--lift-gdn-guard", action="store_true")
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    suite = suite_file()["shapes"]
    shapes = ["suite"] if args.shapes is None else [f"{suite[i]['B']},{suite[i]['T']},{suite[i]['H']}"
                                                    for i in args.shapes]
    out = ["bench", "--device", "cuda", "--op", *args.ops, "--policy", args.policy, "--backend", args.backend,
           "--shapes", *shapes]
    out += ["--lift-gdn-guard"] if args.lift_gdn_guard else []
    out += ["--json", args.json] if args.json else []
    return out + rest


def main(argv: list[str] | None = None) -> int:
    from rewy_hf.cli import main as cli_main

    return cli_main(translate(argv))


if __name__ == "__main__":
    sys.exit(main())
