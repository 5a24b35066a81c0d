"""`rewy-hf bench --model X --packed`: padding-free packed fine-tuning as Trainer / TRL feed it. Each
step takes one row packed from documents of log-normal lengths, a new packing each step, with
``position_ids`` and labels as ``DataCollatorWithFlattening`` builds them. The sides (unpatched /
patched, eager / compiled, and with Liger-Kernel where it is installed: Liger patches the model's
classes for the rest of the process, so its sides come last) run one after the other from the same
weights on the same packings. The unpatched sides run transformers' layers as they are, across
document bounds; the documents check before the timing measures how far that is off."""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn

from .compile_bench import SIDES, dynamo_counts, fresh_counts
from .kernel_profile import gpu_time_by_group
from .triton_builds import built_and_tuned
from .model_bench import Snapshot, optimizer_for, step_summary, train_step

LIGER_SIDES = ("unpatched eager + liger", "patched eager + liger", "patched compiled + liger")
ALL_SIDES = SIDES + LIGER_SIDES
CHECK_LENGTHS = (700, 64, 1000)     # then the rest of the row: bounds inside chunks and on a chunk edge
CHECK_TOKENS = 2048


def packed_lengths(T: int, rng: torch.Generator, sigma: float = 1.0) -> list[int]:
    """Document lengths filling T tokens: log-normal around a median of 600 tokens (T / 8 in rows
    shorter than 4,800, so that they too hold several), at least 16, the last one cut at the row's end."""
    median = min(600.0, T / 8)
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


def side_name(side: str) -> str:
    """The side as ``--sides`` spells it: ``patched-compiled-liger``."""
    return side.replace(" + ", "-").replace(" ", "-")


def _grads_rel_err(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    # over all parameters together, one parameter at a time (a 2 B-parameter model's gradients do not
    # fit in float64 twice)
    num = sum(float((mine[n].float() - g.float()).square().sum()) for n, g in ref.items() if n in mine)
    den = sum(float(g.float().square().sum()) for g in ref.values())
    return math.sqrt(num / den) if den else math.sqrt(num)


def documents_check(model: nn.Module, device, backend: str = "auto", seed: int = 123) -> dict:
    """The unpatched and the patched model (in their own dtype) on one packed row and on its documents
    run one by one, each against the patched model in float32 on the documents one by one (rewy's cores
    are checked against float64 by `rewy-hf verify`; FLA's GDN backward is not trusted everywhere). The
    documents-alone figure is the model's own rounding; a row that keeps its documents apart comes near it."""
    import copy

    from ..parity.packed import Readout, backward_through, documents_alone, packed_row, trainable_grads
    from ..patching.patch import patch_model, unpatch_model
    from ..rel_error import rel_err

    vocab = model.config.vocab_size
    lens = [*CHECK_LENGTHS, CHECK_TOKENS - sum(CHECK_LENGTHS)]
    tokens = torch.randint(3, vocab, (CHECK_TOKENS,), generator=torch.Generator().manual_seed(seed))
    docs = list(tokens.to(device).split(lens))
    readout = Readout(CHECK_TOKENS, torch.float32, seed, device)
    unpatch_model(model)
    reference = copy.deepcopy(model).float()
    patch_model(reference, backend=backend)
    ref_logits, ref_grads = documents_alone(reference, docs, readout)
    del reference

    def errors(logits, grads) -> dict:
        return {"logits_rel_err": rel_err(logits.float(), ref_logits), "grads_rel_err": _grads_rel_err(grads, ref_grads)}

    out = {"lengths": lens, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "reference": "the patched model in float32, documents run one by one"}
    for side in ("unpatched", "patched"):
        (patch_model(model, backend=backend) if side == "patched" else unpatch_model(model))
        alone = errors(*documents_alone(model, docs, readout))
        model.zero_grad(set_to_none=True)
        logits = backward_through(model, packed_row(docs, False, device), readout)
        out[side] = {"packed": errors(logits, trainable_grads(model)), "alone": alone}
        model.zero_grad(set_to_none=True)
    unpatch_model(model)
    return out


def liger_patch(model: nn.Module):
    """Liger-Kernel's patch for ``model``'s family, or None where it has none or is not installed."""
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError:
        return None
    family = type(model).__module__.split(".")[-2] if "transformers.models" in type(model).__module__ else ""
    return getattr(monkey_patch, f"apply_liger_kernel_to_{family}", None)


def side_summary(ms: list[float], tokens: int) -> dict:
    """The step-time figures of a side, with its slowest steps: a tuning stall shows there."""
    out = step_summary(ms, tokens)
    med, after3 = out["median_step_ms"], ms[3:]
    return out | {"p90_step_ms": sorted(ms)[int(0.9 * (len(ms) - 1))], "max_step_ms": max(ms),
                  "slowest_after_step_3_x_median": max(after3) / med if after3 else None}


def run_sides(model: nn.Module, batches: list[dict], warmup: int, backend: str, policy: str,
              sides: tuple[str, ...], on_side, step=lambda label, units=1: None, on_partial=None) -> None:
    """Time each side in turn; ``on_side(side, row)`` as each finishes, and ``on_partial(side, row)``
    after each of its timed steps, with the steps so far and ``stopped_after_steps``: a run stopped in
    the middle of a side (a time limit, Ctrl-C) keeps what that side measured."""
    from ..patching.dispatch import dispatch_report
    from ..patching.patch import patch_model, unpatch_model

    cuda = batches[0]["input_ids"].is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    opt = optimizer_for(model, 1e-5)
    train_step(model, opt, batches[0])          # AdamW's state exists before any timed step
    snap = Snapshot(model, opt, on="cpu")      # 6 bytes a parameter that the steps may need
    compiled = torch.compile(model)
    tokens = batches[0]["input_ids"].numel()
    # Liger patches the model's classes for the rest of the process: its sides come last.
    for side in sorted(sides, key=lambda x: (x.endswith("+ liger"), ALL_SIDES.index(x))):
        if side.endswith("+ liger"):
            apply = liger_patch(model)
            if apply is None:
                on_side(side, {"skipped": "Liger-Kernel is not installed or has no patch for this model"})
                continue
            apply(model=model)
        snap.restore()
        patched, is_compiled = side.startswith("patched"), "compiled" in side
        unpatch_model(model)
        if patched:
            patch_model(model, backend=backend, policy=policy)
        run = compiled if is_compiled else model
        fresh_counts(compile_from_scratch=True)
        ms, warm_ms, losses, builds = [], [], [], []
        sync()
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

        def so_far() -> dict:
            return {**side_summary(ms, tokens), "warmup_step_ms": list(warm_ms),
                    "peak_mb": (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None,
                    "loss": list(losses), "dispatch": dispatch_report(),
                    **({"triton_builds_per_step": list(builds)} if cuda else {})}

        held = built_and_tuned() if cuda else None
        # the first step may take minutes (compiling, Triton builds) before the bar moves
        step(f"{side}: first step, {'compiling' if is_compiled else 'building kernels'}", 0)
        for i, batch in enumerate([batches[0]] * warmup + batches):
            t0 = time.perf_counter()
            losses.append(train_step(run, opt, batch))
            sync()
            (ms if i >= warmup else warm_ms).append((time.perf_counter() - t0) * 1e3)
            if cuda:                        # kernels compiled + picks tuned during the timed step
                now = built_and_tuned()
                if i >= warmup:
                    builds.append(sum(now) - sum(held))
                held = now
            step(side)
            if on_partial is not None and ms:
                on_partial(side, so_far() | {"stopped_after_steps": len(ms)})
        row = so_far()
        if is_compiled:
            row.update(dynamo_counts())
        if cuda:
            row.update(gpu_time_by_group(lambda: train_step(run, opt, batches[-1])))
        on_side(side, row)
    unpatch_model(model)


def run_packed_bench(model: nn.Module, *, device: str, steps: int, warmup: int, seq_len: int, seed: int,
                     backend: str, policy: str, sides: tuple[str, ...], check: bool, on_side,
                     on_check=lambda c: None, step=lambda label, units=1: None, on_partial=None) -> dict:
    """The documents check (unless ``check`` is False), then the timed sides; returns what they
    measured besides the sides (given to ``on_side`` one by one)."""
    out: dict = {}
    if check:
        out["documents_check"] = documents_check(model, device, backend)
        on_check(out["documents_check"])
    vocab = model.config.vocab_size
    batches, lens = packings(steps, seq_len, vocab, seed=seed, device=device)
    out["documents_per_step"] = [len(x) for x in lens]
    out["longest_document_per_step"] = [max(x) for x in lens]
    if sides:
        run_sides(model, batches, warmup, backend, policy, sides, on_side, step, on_partial)
    return out


def packed_summary(data: dict) -> dict:
    """Against the fastest unpatched side: each side's speed-up and peak-memory ratio."""
    sides = {k: v for k, v in data.get("sides", {}).items() if "skipped" not in v}
    unpatched = {k: v for k, v in sides.items() if k.startswith("unpatched")}
    if not unpatched:
        return {}
    best = max(unpatched, key=lambda k: unpatched[k]["tokens_per_s"])
    ref = unpatched[best]
    return {"fastest_unpatched": best,
            "vs_fastest_unpatched": {k: {"speedup": v["tokens_per_s"] / ref["tokens_per_s"],
                                         "peak_ratio": v["peak_mb"] / ref["peak_mb"] if v["peak_mb"] else None}
                                     for k, v in sides.items()}}


def packed_problems(data: dict) -> list[str]:
    """Why a packed run does not show rewy at work and correct, if it does not (empty: it does)."""
    from ..patching.dispatch import total_calls

    problems = []
    for side, r in data.get("sides", {}).items():
        if "skipped" in r:
            continue
        if "stopped_after_steps" in r:
            problems.append(f"the {side} side stopped after {r['stopped_after_steps']} of "
                            f"{data.get('settings', {}).get('steps', '?')} steps")
        if side.startswith("patched") and total_calls(r["dispatch"], "optimized_backward_calls") == 0:
            problems.append(f"the {side} side ran no optimized backward")
        if not all(math.isfinite(x) for x in r["loss"]):
            problems.append(f"a loss of the {side} side was not finite")
    check = data.get("documents_check")
    if check:
        c = check["patched"]
        # the packed row may round differently from the documents alone, not by more than twice as much
        for what in ("logits_rel_err", "grads_rel_err"):
            if c["packed"][what] > 2 * c["alone"][what] + 1e-3:
                problems.append(f"the patched packed row's {what.split('_')[0]} are {c['packed'][what]:.3g} off the "
                                f"documents alone (float32), against {c['alone'][what]:.3g} for the documents alone "
                                "in the model's dtype")
    return problems
