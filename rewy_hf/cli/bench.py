"""`rewy-hf bench`: speed and correctness evidence you can rerun on your own machine.

Op level (default): FLA 0.6.0's op against rewy's, in one process, alternating,
median of repeated rounds after warm-up, for the boundaries B (backward only,
given the saved forward graph) and FB (forward + backward), plus peak memory
and a gradient check of every timed configuration against a higher-precision
reference. On CPU the baseline is autograd through rewy's reference
recurrence instead of FLA, and the output says so.

Model level (``--model``): one whole training step (forward + loss backward +
AdamW step + zero_grad), the same model instance unpatched and patched.

The developer measurements (further baselines, kernel profiles, context
parallelism, the tables of kept runs) are the repository's dev/bench_lab, which
builds this parser and adds its own options.

Exit codes: 0 every check passed; 1 a check failed (a gradient error over its
bound or a rewy crash; at model level: no layer patched, no optimized backward
ran, or a non-finite loss); 2 could not run (bad options, no CUDA, --plot
without matplotlib, a model that cannot be loaded, patched or stepped).
"""

from __future__ import annotations

import argparse
import sys

from ..validation import POLICIES
from .options import NO_CUDA, JsonReport, add_backend, add_dtype, add_json, at_least, chosen_device

HELP = "time FLA vs rewy per op (with a gradient check of every configuration), or a whole model's training step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_op_arguments(parser.add_argument_group("op level"))
    add_model_arguments(parser.add_argument_group("model level (--model)"))


def add_common_arguments(parser) -> None:
    parser.add_argument("--model", default=None, metavar="SPEC",
                        help="model-level bench of this hub id, local directory or preset (qwen3.5-1b, gdn2-1b, "
                             "tiny-qwen3.5, tiny-fla-gdn2, ...); without it the op-level bench runs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if available, else cpu (CPU compares against the reference path, not FLA)")
    parser.add_argument("--policy", nargs="+", action="extend", choices=(*POLICIES, "both"), default=None,
                        help="what rewy's forward saves for backward; op level default: both; model level: one "
                             "(default recompute)")
    add_backend(parser)
    parser.add_argument("--warmup", type=at_least(0), default=None,
                        help="untimed runs per side first (op default: 3 on CUDA, 1 on CPU; model: 2 / 1 steps)")
    parser.add_argument("--lift-gdn-guard", action="store_true",
                        help="let FLA 0.6.0 run its GDN backward on Hopper with triton < 3.7.1 (which it refuses, FLA "
                             "#640) so it can be timed; that baseline is marked timing only and its gradients are "
                             "never compared")
    add_json(parser, "settings, versions and every row")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="bar chart of the speedups, or of the model level's step times (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (and the model's weights)")


def add_op_arguments(ops) -> None:
    from ..bench.config import BOUNDARIES
    from ..op_inputs import OPS

    ops.add_argument("--op", nargs="+", action="extend", choices=(*OPS, "all"), default=None,
                     help="ops to run (default: all)")
    ops.add_argument("--boundary", nargs="+", action="extend", choices=(*BOUNDARIES, "both"), default=None,
                     help="B = backward only (forward graph built outside the timing), FB = forward + backward "
                          "(default: both)")
    ops.add_argument("--shapes", nargs="+", action="extend", type=parse_shape, default=None, metavar="SHAPE",
                     help="'suite' (default: the six-shape GPU suite; on CPU one small shape) or B,T,H[,K,V] "
                          "(K = V = 128 on CUDA, 64 on CPU when left out); repeatable")
    ops.add_argument("--reps", type=at_least(1), default=None,
                     help="timed rounds per side, alternating (default 5 on CUDA, 3 on CPU); the median is "
                          "reported. On CUDA each round is one triton do_bench median over --rep-ms")
    ops.add_argument("--keep-autotune-picks", action="store_true",
                     help="CUDA: keep Triton's autotune picks from one shape to the next (default: forget them "
                          "before each shape, so each is timed with the configs tuned at it, as a run at that "
                          "shape alone would be; FLA's keys leave out B and T)")
    ops.add_argument("--rep-ms", type=float, default=50.0, help="CUDA: milliseconds of runs per round")
    ops.add_argument("--check-max-tokens", type=at_least(64), default=2**19, metavar="N",
                     help="shapes with B*T*H above N are gradient-checked at a reduced T (same B, H; said in the "
                          "output) to save time and memory")


def add_model_arguments(model) -> None:
    from ..bench.config import MODEL_DTYPES

    model.add_argument("--seq-len", type=at_least(1), default=None,
                       help="tokens per sequence (default 4096 on CUDA, 128 on CPU)")
    model.add_argument("--batch-size", type=at_least(1), default=1, help="sequences per step")
    model.add_argument("--steps", type=at_least(1), default=None,
                       help="timed steps per side (default 10 on CUDA, 2 on CPU)")
    add_dtype(model, MODEL_DTYPES, None, "model dtype (default bfloat16 on CUDA, float32 on CPU)")
    model.add_argument("--compile", action="store_true",
                       help="time four sides: unpatched and patched, each eager and under torch.compile (or "
                            "some: --sides)")
    model.add_argument("--curve-steps", type=at_least(1), default=None, metavar="N",
                       help="--compile: each side also trains N consecutive steps on fresh batches of the bundled "
                            "corpus from the same weights, and its loss curve is compared with the unpatched eager one")
    model.add_argument("--lengths", type=parse_lengths, default=(), metavar="T,T,...",
                       help="--compile: each compiled side also runs one step at each of these sequence lengths "
                            "and reports how many graphs each compiled (0: no recompile)")
    model.add_argument("--sides", type=parse_sides, default=None, metavar="SIDE,SIDE,...",
                       help="--compile: run only these of the four sides (unpatched-eager, patched-eager, "
                            "patched-compiled, unpatched-compiled); --packed: also unpatched-eager-liger, "
                            "patched-eager-liger, patched-compiled-liger; e.g. to time the slow-to-compile unpatched "
                            "compiled side in a run of its own (in a clone, dev/bench_lab --from-json joins runs "
                            "on the same settings into one table; default: all four)")
    model.add_argument("--causal-masks", action="store_true",
                       help="--compile: every side hands a transformers hybrid the mask mapping of an unpadded "
                            "causal batch (models/causal_masks.py), so that compiled attention runs SDPA's causal "
                            "kernel as eager attention does, instead of a materialized mask")
    model.add_argument("--packed", action="store_true",
                       help="time padding-free packed fine-tuning as Trainer / TRL feed it: one row of --seq-len "
                            "tokens (default 8192) packed from long-tailed documents, a new packing each of --steps "
                            "steps (default 50), on up to seven sides: unpatched / patched, eager / compiled, with "
                            "Liger-Kernel where it is installed (--sides names them, or `none` for the documents "
                            "check alone); before the timing, a packed row against its documents run one by one")
    model.add_argument("--no-documents-check", action="store_true",
                       help="--packed: skip the packed row's check against its documents run one by one")
    model.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="let transformers run the model repository's own code")


def parse_shape(text: str):
    """argparse type for --shapes: 'suite' or B,T,H[,K,V][,packed=N] (positive integers; packed: one
    row of T tokens from N sequences, B = 1): a ``CustomShape``, or SUITE."""
    from ..bench.config import SUITE, CustomShape

    if text.strip().lower() == SUITE:
        return SUITE
    parts = [p.strip() for p in text.split(",")]
    example = ("e.g. --shapes 2,4096,16 or --shapes 2,4096,16,128,128 or --shapes 1,32768,32,packed=8 "
               "(or --shapes suite)")
    packed = 0
    if parts and parts[-1].startswith("packed="):
        try:
            packed = int(parts.pop()[len("packed="):])
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {text!r}: packed=N needs an integer N, {example}") from None
    if len(parts) not in (3, 5):
        raise argparse.ArgumentTypeError(
            f"shape {text!r} has {len(parts)} value(s); give B,T,H or B,T,H,K,V, {example}")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not a list of integers; give B,T,H or B,T,H,K,V, {example}") from None
    names = ("B", "T", "H", "K", "V")
    bad = [f"{n}={v}" for n, v in zip(names, values) if v <= 0] + ([f"packed={packed}"] if packed < 0 else [])
    if bad:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: {', '.join(bad)} must be positive; give B,T,H or B,T,H,K,V as positive integers, "
            f"{example}")
    if packed and (values[0] != 1 or packed > values[1]):
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: packed sequences come in one row of at least one token each: give B = 1 and "
            f"packed <= T, {example}")
    if len(values) == 3:
        values += [None, None]
    return CustomShape(*values, N=packed)


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of sequence lengths, "
                                         "e.g. 2048,8192") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every sequence length must be 1 or more")
    return lengths


def parse_sides(text: str) -> tuple[str, ...]:
    from ..bench.packed_bench import ALL_SIDES, side_name

    if text.strip() == "none":
        return ()
    names = {side_name(side): side for side in ALL_SIDES}
    picked = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in picked if x not in names]
    if unknown or not picked:
        raise argparse.ArgumentTypeError(f"{text!r}: sides are {', '.join(names)} (comma-separated; the -liger "
                                         "ones with --packed only), or none")
    return tuple(side for name, side in names.items() if name in picked)


def run(args: argparse.Namespace, report: JsonReport | None = None, **more) -> int:
    """A live run on the chosen device; its --json report goes to ``report`` (default: where --json says),
    ``more`` to ``run_bench`` (what a caller adds to the run)."""
    from ..bench.runner import CouldNotRun, run_bench

    try:
        device = chosen_device(args.device)
        if device is None:
            raise CouldNotRun(f"{NO_CUDA} (a comparison against the reference path) or a CUDA build of torch")
        return run_bench(args, device, report or JsonReport(args.json), **more)
    except CouldNotRun as exc:
        print(f"rewy-hf bench: {exc}", file=sys.stderr)
        return 2
