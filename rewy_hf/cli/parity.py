"""`rewy-hf parity`: prove on your own model that rewy changes nothing it computes.

With ``--packed`` it checks a padding-free packed row instead: the patched
model's row against its documents run one by one (the unpatched model's
figures shown beside it, rewy_hf/parity/packed.py).

Exit codes: 0 parity holds, 1 a tolerance was violated (with ``--packed``: by
the patched model), 2 could not run (load failure, no supported layer,
unsupported configuration, no optimized backward ran, or a crash on either
side, whose traceback is printed).
"""

from __future__ import annotations

import argparse
import sys
import traceback

from ..validation import POLICIES
from .options import (DTYPES, NO_CUDA, JsonReport, add_backend, add_device, add_dtype, add_json, at_least, tolerance,
                      chosen_device)

HELP = "compare loss and gradients of your model patched vs unpatched (exit 0 = parity holds)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="hub id, local directory, or preset (see --list-presets); required unless --list-presets")
    parser.add_argument("--list-presets", action="store_true",
                        help="print the presets and the supported architectures, then exit")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    add_device(parser, "where to run (default: cuda if available, else cpu)")
    add_dtype(parser, DTYPES, "float32", "the model's dtype (both sides)")
    parser.add_argument("--packed", action="store_true",
                        help="instead of batches, check one padding-free packed row of --seq-len tokens (documents "
                             "of 64, then about 58 %%, 1 and the rest) against its documents run one by one, "
                             "patched and unpatched; exit 1 only where the patched model's row differs. "
                             "--batch-size and --steps do not apply")
    parser.add_argument("--batch-size", type=at_least(1), default=2, help="sequences per batch")
    parser.add_argument("--seq-len", type=at_least(1), default=128,
                        help="tokens per sequence (> 64: FLA's DeltaNet layer runs its chunk core only above 64; "
                             "with --packed at least 67)")
    parser.add_argument("--steps", type=at_least(1), default=2, help="forward+backward repetitions, fresh batch each")
    parser.add_argument("--text-file", default=None,
                        help="draw batches from this text through the model's tokenizer (default: random tokens)")
    parser.add_argument("--lora", action="store_true", help="compare under a PEFT LoRA wrap (all linear layers)")
    parser.add_argument("--policy", choices=POLICIES, default="recompute",
                        help="what rewy's forward saves for backward")
    add_backend(parser)
    parser.add_argument("--tolerance", type=tolerance, default=None,
                        help="relative gradient tolerance (default per dtype: float32 1e-3, bfloat16 1e-1, float64 "
                             "1e-7; with --packed it judges the logits too, and float64's is 1e-6)")
    parser.add_argument("--loss-tolerance", type=tolerance, default=None,
                        help="relative loss tolerance (default per dtype: float32 1e-5, bfloat16 2e-2)")
    parser.add_argument("--no-update", action="store_true", help="skip the optimizer-step comparison")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="run both sides through torch.compile (default backend: inductor): rewy's core "
                             "against the model's own, compiled; beside an eager run it separates what patching "
                             "changes from what compiling changes")
    parser.add_argument("--reference", choices=("auto", "original", "torch"), default="auto",
                        help="what the unpatched side runs: its original core ('original'), the plain-torch / "
                             "float64 reference core ('torch'), or 'auto' = original on CUDA, torch on CPU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batches and preset weights")
    add_json(parser, "the full report")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let transformers run the model repository's own code")


def list_presets() -> str:
    from ..adapters import all_adapters
    from ..models.loading import preset_names

    lines = ["presets (random weights from a fixed seed, no download):"]
    lines += [f"  {name}" for name in preset_names()]
    rows = [(a.source, a.op, cls) for a in all_adapters() for cls in a.layer_classes]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines += ["", "supported architectures (delta-rule layer classes rewy-hf patches; --model takes any model "
              "that has one):"]
    lines += [f"  {source:<{widths[0]}}  {op:<{widths[1]}}  {cls}" for source, op, cls in rows]
    return "\n".join(lines)


# Options of the batch comparison that change nothing about a packed row: refused with --packed
# rather than ignored.
_BATCH_ONLY = (("compile", "--compile"), ("no_update", "--no-update"), ("loss_tolerance", "--loss-tolerance"))


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        print(list_presets())
        return 0
    if args.model is None:
        print("rewy-hf parity: --model is required: a hub id, a local directory or a preset "
              "(rewy-hf parity --list-presets lists the presets)", file=sys.stderr)
        return 2
    given = [flag for attr, flag in _BATCH_ONLY if getattr(args, attr) not in (None, False)]
    if args.packed and given:
        print(f"rewy-hf parity: {', '.join(given)} apply to the batch comparison, not to --packed (one packed row, "
              "eager, judged by --tolerance): drop them, or run without --packed", file=sys.stderr)
        return 2

    import torch

    from ..cpu_triton import enable_cpu_interpreter
    from ..errors import UnsupportedConfigError
    from ..models.loading import ModelLoadError, load_causal_lm
    from ..parity.comparison import DEFAULT_TOLERANCES, OriginalCoreError, Tolerance, run_parity
    from ..parity.inputs import token_batches, with_lora
    from ..parity.output import format_packed, format_result, progress_bar
    from ..parity.packed import PACKED_TOLERANCES, document_lengths, run_packed_parity

    device = chosen_device(args.device)
    if device is None:
        print(f"rewy-hf parity: {NO_CUDA}", file=sys.stderr)
        return 2
    if device == "cpu":
        enable_cpu_interpreter()
    dtype = getattr(torch, args.dtype)
    base = (PACKED_TOLERANCES if args.packed else DEFAULT_TOLERANCES)[dtype]
    # An explicit 0 is a request for an exact match, not "use the default".
    tol = Tolerance(loss_rel=base.loss_rel if args.loss_tolerance is None else args.loss_tolerance,
                    grad_rel=base.grad_rel if args.tolerance is None else args.tolerance,
                    min_cosine=base.min_cosine)
    report = JsonReport(args.json)
    reference_cores = None if args.reference == "auto" else args.reference == "torch"

    def could_not_run(reason: str) -> int:
        print(f"rewy-hf parity: could not run: {reason}", file=sys.stderr)
        report.finish({"ok": False, "exit_code": 2, "error": reason, "model": args.model})
        return 2

    with report.human_output():
        try:
            if args.packed:
                document_lengths(args.seq_len)      # a --seq-len too short is refused before the model loads
            loaded = load_causal_lm(args.model, revision=args.revision, dtype=dtype, device=device,
                                    trust_remote_code=args.trust_remote_code, seed=args.seed)
            model = loaded.model
            if args.lora:
                model = with_lora(model)
            # --packed packs one row's worth of the same tokens (random, or --text-file's) into documents
            batches = token_batches(model, loaded.tokenizer, batch_size=1 if args.packed else args.batch_size,
                                    seq_len=args.seq_len, steps=1 if args.packed else args.steps, seed=args.seed,
                                    text_file=args.text_file, name=args.model)
            if args.packed:
                result = run_packed_parity(model, batches[0][0], tolerance=tol, seed=args.seed, backend=args.backend,
                                           policy=args.policy, reference_cores=reference_cores)
            else:
                with progress_bar(args.steps, f"parity {args.model}") as advance:
                    result = run_parity(model, batches, tolerance=tol, backend=args.backend, policy=args.policy,
                                        check_update=not args.no_update, progress=advance,
                                        compile_backend=args.compile, reference_cores=reference_cores)
        except OriginalCoreError as exc:  # e.g. FLA's Hopper guard refusing its GDN backward
            return could_not_run(f"the unpatched model's own core failed: {exc}; try --reference torch "
                                 "(the unpatched side then runs the plain-torch / float64 reference core)")
        except (ModelLoadError, UnsupportedConfigError, ValueError) as exc:
            return could_not_run(str(exc))
        except Exception as exc:
            # a crash on either side: its traceback is the evidence, so it is printed before the summary
            traceback.print_exc(file=sys.stderr)
            return could_not_run(f"{type(exc).__name__}: {exc}")

        if result.optimized_backward_calls == 0:
            return could_not_run(
                "the patched model ran no optimized backward (its layers never reached the chunked core); "
                "FLA's DeltaNet uses a recurrent kernel for sequences of 64 tokens or fewer: raise --seq-len")
        show = format_packed if args.packed else format_result
        print(show(result, model=args.model, dtype=args.dtype, device=device))
    report.finish({"model": args.model, "device": device, "dtype": args.dtype, "exit_code": 0 if result.ok else 1,
                   **({"ok": result.ok, "packed": result.to_dict()} if args.packed else result.to_dict())})
    return 0 if result.ok else 1
