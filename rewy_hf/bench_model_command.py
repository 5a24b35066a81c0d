"""`rewy-hf bench --model`: options, loading, output and exit code of the model-level bench."""

from __future__ import annotations

import sys


def _could_not_run(message: str, save, data: dict) -> int:
    print(f"rewy-hf bench: could not run: {message}", file=sys.stderr)
    data.update(ok=False, exit_code=2, error=message, complete=True)
    save(data)
    return 2


def run_model(args, device: str, guard: dict) -> int:
    import torch

    from .bench_command import _DTYPES, defaults_for
    from .bench_config import POLICIES, expand
    from .bench_model import ModelSettings, run_model_bench
    from .bench_output import environment, format_model_result, plot_model_steps, progress, writer
    from .errors import UnsupportedConfigError
    from .model_loading import ModelLoadError, load_causal_lm

    op_only = [flag for flag, value in (("--op", args.op), ("--shapes", args.shapes), ("--boundary", args.boundary),
                                        ("--reps", args.reps)) if value]
    if op_only:
        print(f"rewy-hf bench: {', '.join(op_only)} apply to the op-level bench; drop them, or drop --model "
              "(the model level times --steps training steps)", file=sys.stderr)
        return 2
    policies = expand(args.policy, POLICIES, "both", ("recompute",))
    if len(policies) != 1:
        print("rewy-hf bench: --model takes one --policy (recompute or full); run it once per policy",
              file=sys.stderr)
        return 2
    d = defaults_for(device)
    dtype_name = args.dtype or d["dtype"]
    s = ModelSettings(device=device, steps=args.steps or d["steps"],
                      warmup=d["warmup"] if args.warmup is None else args.warmup, batch_size=args.batch_size,
                      seq_len=args.seq_len or d["seq_len"], backend=args.backend, policy=policies[0], seed=args.seed)
    settings = {"model": args.model, "device": device, "dtype": dtype_name, "batch_size": s.batch_size,
                "seq_len": s.seq_len, "steps": s.steps, "warmup": s.warmup, "backend": s.backend,
                "policy": s.policy, "optimizer": f"AdamW(lr={s.lr:g})", "seed": s.seed, "gdn_guard": guard,
                "timing": "time.perf_counter around one full step (device synchronised before and after); "
                          "weights and optimizer state restored before every step, outside the timing; sides "
                          "alternate and swap order every step",
                "peak_memory": "torch.cuda.max_memory_allocated during the step minus what was allocated before "
                               "it (weights, optimizer state, the restore snapshot)"}
    data = {"kind": "model", **environment(device), "settings": settings, "complete": False}
    save = writer(args.json)
    dtype = getattr(torch, _DTYPES[dtype_name])
    print(f"rewy-hf bench (model level) on {data['device_name']}: loading {args.model} ({dtype_name})", flush=True)
    try:
        loaded = load_causal_lm(args.model, revision=args.revision, dtype=dtype, device=device,
                                trust_remote_code=args.trust_remote_code, seed=args.seed)
    except (ModelLoadError, ValueError) as exc:
        return _could_not_run(str(exc), save, data)
    model = loaded.model
    settings["parameters"] = sum(p.numel() for p in model.parameters())
    try:
        with progress(s.warmup + s.steps, f"bench {args.model}") as bar:
            res = run_model_bench(model, s, progress=bar.step)
    except UnsupportedConfigError as exc:
        return _could_not_run(str(exc), save, data)
    except Exception as exc:   # e.g. the unpatched core refusing to run on this GPU
        hint = ""
        if "#640" in str(exc):
            hint = ("; FLA refuses its GDN backward here (Hopper, triton < 3.7.1): add --lift-gdn-guard to time the "
                    "unpatched side anyway")
        return _could_not_run(f"{type(exc).__name__}: {exc}{hint}", save, data)

    print(format_model_result(res, args.model, settings))
    problems = []
    if res["patched_layers"] == 0:
        problems.append("no layer was patched")
    if res["optimized_backward_calls"] == 0:
        problems.append("the patched side ran no optimized backward (its layers never reached the chunked core; "
                        "FLA's DeltaNet uses a recurrent kernel for sequences of 64 tokens or fewer: raise --seq-len)")
    if not res["losses_finite"]:
        problems.append("a loss was not finite")
    data.update(res)
    data.update(ok=not problems, exit_code=1 if problems else 0, problems=problems, complete=True)
    save(data)
    from .bench_command import _write_markdown

    _write_markdown(args, data)
    if args.plot:
        plot_model_steps(res, args.plot, f"{args.model}, {s.batch_size}x{s.seq_len} tokens, {dtype_name}, "
                                         f"{data['device_name']}")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0
