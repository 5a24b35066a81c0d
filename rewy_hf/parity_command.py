"""`rewy-hf parity`: prove on your own model that rewy changes nothing it computes.

Exit codes: 0 parity holds, 1 a tolerance was violated, 2 could not run
(load failure, no supported layer, unsupported configuration, or no optimized
backward ran).
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "compare loss and gradients of your model patched vs unpatched (exit 0 = parity holds)"

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float64": "float64", "float16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="hub id, local directory, or preset (see --list-presets)")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128,
                        help="tokens per sequence (> 64: FLA's DeltaNet layer runs its chunk core only above 64)")
    parser.add_argument("--steps", type=int, default=2, help="forward+backward repetitions, fresh batch each")
    parser.add_argument("--text-file", default=None, help="draw batches from this text through the model's tokenizer")
    parser.add_argument("--lora", action="store_true", help="compare under a PEFT LoRA wrap (all linear layers)")
    parser.add_argument("--policy", choices=("recompute", "full"), default="recompute")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="relative gradient tolerance (default per dtype: float32 1e-3, bfloat16 1e-1)")
    parser.add_argument("--loss-tolerance", type=float, default=None, help="relative loss tolerance")
    parser.add_argument("--no-update", action="store_true", help="skip the optimizer-step comparison")
    parser.add_argument("--reference", choices=("auto", "original", "torch"), default="auto",
                        help="what the unpatched side runs: its original core ('original'), the plain-torch / "
                             "float64 reference core ('torch'), or 'auto' = original on CUDA, torch on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--trust-remote-code", action="store_true")


def run(args: argparse.Namespace) -> int:
    import torch

    from .cpu_triton import enable_cpu_interpreter
    from .errors import UnsupportedConfigError
    from .model_loading import ModelLoadError, load_causal_lm
    from .parity import DEFAULT_TOLERANCES, Tolerance, run_parity
    from .parity_output import format_result, progress_bar

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        enable_cpu_interpreter()
    dtype = getattr(torch, _DTYPES[args.dtype])
    base = DEFAULT_TOLERANCES[dtype]
    tol = Tolerance(loss_rel=args.loss_tolerance or base.loss_rel, grad_rel=args.tolerance or base.grad_rel,
                    min_cosine=base.min_cosine)

    def could_not_run(reason: str) -> int:
        print(f"rewy-hf parity: could not run: {reason}", file=sys.stderr)
        if args.json:
            _write_json(args.json, {"ok": False, "exit_code": 2, "error": reason, "model": args.model})
        return 2

    try:
        loaded = load_causal_lm(args.model, revision=args.revision, dtype=dtype, device=device,
                                trust_remote_code=args.trust_remote_code, seed=args.seed)
        model = loaded.model
        if args.lora:
            model = _wrap_lora(model)
        batches = _batches(args, model, loaded.tokenizer)
        with progress_bar(args.steps, f"parity {args.model}") as advance:
            result = run_parity(model, batches, tolerance=tol, backend=args.backend, policy=args.policy,
                                check_update=not args.no_update, progress=advance,
                                reference_cores=None if args.reference == "auto" else args.reference == "torch")
    except (ModelLoadError, UnsupportedConfigError, ValueError) as exc:
        return could_not_run(str(exc))
    except Exception as exc:  # e.g. the original core refusing to run on this GPU (FLA's Hopper guard)
        hint = "" if args.reference == "torch" else "; try --reference torch"
        return could_not_run(f"{type(exc).__name__}: {exc}{hint}")

    if result.optimized_backward_calls == 0:
        return could_not_run(
            "the patched model ran no optimized backward (its layers never reached the chunked core); "
            "FLA's DeltaNet uses a recurrent kernel for sequences of 64 tokens or fewer: raise --seq-len")
    print(format_result(result, model=args.model, dtype=args.dtype, device=device))
    report = {"model": args.model, "device": device, "dtype": args.dtype, "exit_code": 0 if result.ok else 1,
              **result.to_dict()}
    if args.json:
        _write_json(args.json, report)
    return 0 if result.ok else 1


def _wrap_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))


def _batches(args, model, tokenizer):
    import torch

    vocab = model.config.vocab_size
    shape = (args.batch_size, args.seq_len)
    if args.text_file is None:
        gen = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab, shape, generator=gen) for _ in range(args.steps)]
    if tokenizer is None:
        raise ValueError(f"--text-file needs a tokenizer, and {args.model!r} has none; drop --text-file to use "
                         "random tokens")
    with open(args.text_file, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids.flatten()
    need = args.batch_size * args.seq_len
    if ids.numel() < need:
        raise ValueError(f"--text-file has {ids.numel()} tokens, fewer than one batch ({need}); use a longer file "
                         "or a smaller --batch-size/--seq-len")
    n = ids.numel() // need
    return [ids[(s % n) * need:(s % n + 1) * need].view(shape) for s in range(args.steps)]


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
