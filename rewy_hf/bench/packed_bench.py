"""A padding-free packed fine-tuning run, the way Trainer / TRL feed it, on each configuration.

Every step takes one row of ``seq_len`` tokens packed from documents whose
lengths follow a long-tailed (log-normal) distribution, the last one cut at
the row's end, with a new packing each step: ``position_ids`` restart at each
document and the first label of each document is -100, as
``DataCollatorWithFlattening`` builds them. The sides run one after the other
on one model instance (patched and unpatched by ``patch_model`` /
``unpatch_model``), each from the same weights and optimizer state and on the
same sequence of packings:

- unpatched eager, patched eager, patched compiled, unpatched compiled;
- where Liger-Kernel is installed and has a patch for the model, the same with
  its kernels (RMSNorm, SwiGLU, fused linear cross-entropy). Liger patches the
  model's classes for the rest of the process, so those sides come last.

Per side: every step's wall time (median, p90, max, and the slowest step after
the third against the median: a tuning stall shows there), tokens/s, peak
memory, compiled graphs and graph breaks, and one profiled step's GPU time by
kernel family. The unpatched sides run transformers' layers as they are, whose
delta-rule cores and short convolutions run across document bounds (their
loss is not the packed documents' loss); the check before the timing measures
how far, against the documents run one by one.

Usage: python -m rewy_hf.bench.packed_bench --model qwen3.5-gva-1b-248k --out run.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn

SIDES = ("unpatched eager", "patched eager", "patched compiled", "unpatched compiled")
LIGER_SIDES = ("unpatched eager + liger", "patched eager + liger", "patched compiled + liger")


def packed_lengths(T: int, rng: torch.Generator, median: float = 600.0, sigma: float = 1.0) -> list[int]:
    """Document lengths filling T tokens: log-normal around ``median`` tokens, at least 16, the
    last one cut at the row's end."""
    lens, total = [], 0
    while total < T:
        n = int(max(16.0, median * math.exp(sigma * torch.randn((), generator=rng).item())))
        n = min(n, T - total)
        lens.append(n)
        total += n
    return lens


def packed_row(lens: list[int], vocab: int, rng: torch.Generator, device) -> dict:
    """input_ids, labels and position_ids of one packed row, as DataCollatorWithFlattening makes them."""
    ids = torch.randint(3, vocab, (1, sum(lens)), generator=rng)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    labels = ids.clone()
    labels[positions == 0] = -100
    return {k: v.to(device) for k, v in dict(input_ids=ids, labels=labels, position_ids=positions).items()}


def packings(steps: int, T: int, vocab: int, seed: int, device) -> tuple[list[dict], list[list[int]]]:
    rng = torch.Generator().manual_seed(seed)
    lens = [packed_lengths(T, rng) for _ in range(steps)]
    return [packed_row(x, vocab, rng, device) for x in lens], lens


def _step(run, opt, batch: dict) -> float:
    loss = run(**batch, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def documents_check(model: nn.Module, vocab: int, device, T: int = 2048) -> dict:
    """The patched and the unpatched model on one packed row against its documents run one by one
    (bf16): the relative error of the logits and of the gradient of every parameter together."""
    from ..patching.patch import patch_model, unpatch_model
    from ..rel_error import rel_err

    rng = torch.Generator().manual_seed(123)
    lens = [700, 64, 1000, T - 1764]
    row = packed_row(lens, vocab, rng, device)

    starts = [0] + list(torch.tensor(lens).cumsum(0)[:-1].tolist())
    alone = [{"input_ids": row["input_ids"][:, s:s + n], "position_ids": row["position_ids"][:, s:s + n]}
             for s, n in zip(starts, lens)]
    out = {"lengths": lens}
    scale = T * model.config.vocab_size

    def grads() -> list[torch.Tensor]:
        return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]

    def grads_rel_err(mine: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
        # over all parameters together, one parameter at a time (a 2 B-parameter model's gradients
        # do not fit in float64 twice)
        num = sum(float((a.float() - b.float()).square().sum()) for a, b in zip(mine, ref))
        den = sum(float(b.float().square().sum()) for b in ref)
        return math.sqrt(num / den) if den else math.sqrt(num)

    for side in ("unpatched", "patched"):
        (patch_model if side == "patched" else unpatch_model)(model)
        # one loss, a sum over the row's tokens: the packed row's gradient is the sum of its documents'
        model.zero_grad(set_to_none=True)
        packed = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
        (packed.float().square().sum() / scale).backward()
        packed_grads = grads()
        model.zero_grad(set_to_none=True)
        logits = []
        for b in alone:
            o = model(**b, use_cache=False).logits
            (o.float().square().sum() / scale).backward()
            logits.append(o.detach()[0])
        out[side] = {"logits_rel_err": rel_err(packed.detach()[0].float(), torch.cat(logits).float()),
                     "grads_rel_err": grads_rel_err(packed_grads, grads())}
    unpatch_model(model)
    model.zero_grad(set_to_none=True)
    return out


def gpu_by_family(run, opt, batch) -> dict:
    from .compile_bench import gpu_time_by_family

    total, per, launches = gpu_time_by_family(lambda: _step(run, opt, batch))
    return {"gpu_ms": total, "gpu_ms_by_family": per, "launches": launches}


def _liger_patch(model: nn.Module):
    """Liger-Kernel's patch for ``model``'s family, or None where it has none or is not installed."""
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError:
        return None
    family = type(model).__module__.split(".")[-2] if "transformers.models" in type(model).__module__ else ""
    return getattr(monkey_patch, f"apply_liger_kernel_to_{family}", None)


def run_sides(model: nn.Module, batches: list[dict], warmup: int, out: dict, save, backend: str, policy: str,
              sides: tuple[str, ...]) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ..patching.dispatch import dispatch_report, reset_dispatch_report
    from ..patching.patch import patch_model, unpatch_model
    from .compile_bench import dynamo_counts
    from .model_bench import Snapshot, optimizer_for

    opt = optimizer_for(model, 1e-5)
    _step(model, opt, batches[0])               # AdamW's state exists before any timed step
    snap = Snapshot(model, opt)
    compiled = torch.compile(model)
    tokens = batches[0]["input_ids"].numel()
    for side in sides:
        if side.endswith("+ liger"):
            apply = _liger_patch(model)
            if apply is None:
                out["sides"][side] = {"skipped": "Liger-Kernel is not installed or has no patch for this model"}
                save()
                continue
            apply(model=model)
        snap.restore()
        patched, is_compiled = side.startswith("patched"), "compiled" in side
        unpatch_model(model)
        if patched:
            patch_model(model, backend=backend, policy=policy)
        run = compiled if is_compiled else model
        torch._dynamo.reset()
        counters.clear()
        reset_dispatch_report()
        ms, losses = [], []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for i, batch in enumerate([batches[0]] * warmup + batches):
            t0 = time.perf_counter()
            losses.append(_step(run, opt, batch))
            torch.cuda.synchronize()
            if i >= warmup:
                ms.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(ms)
        after3 = ms[3:]
        row = {"step_ms": ms, "median_step_ms": med, "p90_step_ms": sorted(ms)[int(0.9 * (len(ms) - 1))],
               "max_step_ms": max(ms), "slowest_after_step_3_x_median": max(after3) / med if after3 else None,
               "tokens_per_s": tokens / med * 1e3, "peak_mb": torch.cuda.max_memory_allocated() / 2**20,
               "loss": losses, "dispatch": dispatch_report()}
        if is_compiled:
            row.update(dynamo_counts())
        row.update(gpu_by_family(run, opt, batches[-1]))
        out["sides"][side] = row
        save()
        print(f"{side}: median {med:.1f} ms, p90 {row['p90_step_ms']:.1f}, max {row['max_step_ms']:.1f}, "
              f"{row['tokens_per_s']:.0f} tok/s, peak {row['peak_mb']:.0f} MB"
              + (f", {row['graphs']} graphs, {row['graph_breaks']} breaks" if is_compiled else ""), flush=True)
    unpatch_model(model)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-gva-1b-248k")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--policy", default="recompute")
    p.add_argument("--sides", default=",".join(SIDES + LIGER_SIDES),
                   help="comma-separated, of: " + ", ".join(SIDES + LIGER_SIDES))
    p.add_argument("--no-check", action="store_true", help="skip the packed-row check against the documents")
    p.add_argument("--lift-gdn-guard", action="store_true",
                   help="let FLA's GDN backward run on Hopper with Triton < 3.7.1 (its guard refuses it there): "
                        "the unpatched GDN sides' times are valid, their gradients are not trusted")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from ..models.presets import build_preset

    sides = tuple(x.strip() for x in args.sides.split(",") if x.strip())
    unknown = [x for x in sides if x not in SIDES + LIGER_SIDES]
    if unknown:
        raise SystemExit(f"unknown sides {unknown}; choose from {', '.join(SIDES + LIGER_SIDES)}")
    guard = None
    if args.lift_gdn_guard:
        from .op_bench import lift_gdn_guard

        guard = lift_gdn_guard()
    model = build_preset(args.model).to("cuda", torch.bfloat16).train()
    vocab = model.config.vocab_size
    out = {"model": args.model, "parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab,
           "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "backend": args.backend,
           "policy": args.policy, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gdn_guard": guard, "sides": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    if not args.no_check:
        out["documents_check"] = documents_check(model, vocab, "cuda")
        save()
        print("documents check:", json.dumps(out["documents_check"]), flush=True)
    batches, lens = packings(args.steps, args.seq_len, vocab, seed=0, device="cuda")
    out["documents_per_step"] = [len(x) for x in lens]
    out["longest_document_per_step"] = [max(x) for x in lens]
    run_sides(model, batches, args.warmup, out, save, args.backend, args.policy, sides)
    save()


if __name__ == "__main__":
    main()
