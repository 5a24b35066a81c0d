"""A script that fails: `--mode raise` raises, `--mode exit N` calls sys.exit(N).
With `--build-model` it first builds a tiny Qwen3.5 (so the run has patched it)."""

import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["raise", "exit"], default="raise")
parser.add_argument("--code", type=int, default=4)
parser.add_argument("--build-model", action="store_true")
args = parser.parse_args()

if args.build_model:
    from _tiny_models import tiny_qwen35

    model = tiny_qwen35()

if args.mode == "raise":
    raise RuntimeError("boom from the training script")
sys.exit(args.code)
