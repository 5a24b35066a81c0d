"""`rewy-hf bench --model X --compile`: one training step four ways (unpatched / patched, eager /
``torch.compile``) on the same weights and optimizer state, each side in a block of its own: switching
a compiled model between patched and unpatched every step would rerun dynamo's guards. The unpatched
compiled side runs the installed kernels (FLA) with their graph breaks (installed_kernels.py says why).
docs/bench.md lists what each side reports."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from ..models.causal_masks import causal_only_masks
from ..patching.dispatch import dispatch_report, reset_dispatch_report, total_calls
from ..patching.patch import unpatch_model
from ..installed_kernels import installed_kernels_under_compile
from .kernel_profile import gpu_time_by_group
from .model_bench import (ModelSettings, ModelSides, Snapshot, optimizer_for, steady_snapshot, step_summary,
                          timed_step, train_step)

# The unpatched compiled side comes last: its graph breaks (one or more in every delta-rule layer)
# give it the most graphs to compile, and a run stopped on time keeps the other three.
SIDES = ("unpatched eager", "patched eager", "patched compiled", "unpatched compiled")
# The loss-curve steps train at this rate, high enough that 50 AdamW steps move the loss by
# far more than the bf16 noise between the sides, so the curves can be compared step by step.
CURVE_LR = 1e-4
CURVE_BATCHES = ("a fresh batch each step: windows at seeded random offsets into the corpus shipped with rewy-hf "
                 "(rewy_hf/training/corpus.txt), bytes as token ids")
HELD_KERNELS = ("the installed kernel package's op with its graph breaks (transformers' kernel wrapper's export "
                "check held False, installed_kernels.py)")


def fresh_counts(compile_from_scratch: bool) -> None:
    """Zero dynamo's counters and the dispatch report for the next side (and forget what dynamo compiled)."""
    import torch._dynamo

    if compile_from_scratch:
        torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    reset_dispatch_report()


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "break_reasons": sorted(counters["graph_break"])[:20]}


def _tokens(model: nn.Module, s: ModelSettings, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (s.batch_size, seq_len),
                         generator=torch.Generator().manual_seed(seed)).to(s.device)


def corpus_batches(model: nn.Module, s: ModelSettings, steps: int) -> list[torch.Tensor]:
    """``steps`` batches of real text, each new: a curve on text stays in the range of a training run's
    losses, where one repeated batch is learned by heart within a few steps and the curves would then
    be compared on losses near zero."""
    from ..training.options import BUNDLED_CORPUS

    ids = torch.tensor(list(BUNDLED_CORPUS.read_bytes()), dtype=torch.long) % model.config.vocab_size
    ids = ids.repeat(-(-(s.seq_len + 1) // ids.numel()) + 1)
    gen = torch.Generator().manual_seed(s.seed + 1)
    starts = torch.randint(0, ids.numel() - s.seq_len, (steps, s.batch_size), generator=gen)
    return [torch.stack([ids[int(a):int(a) + s.seq_len] for a in row]).to(s.device) for row in starts]


def loss_curve(run, opt: torch.optim.Optimizer, batches: list[torch.Tensor], snap: Snapshot) -> list[float]:
    """The losses of ``len(batches)`` consecutive training steps from the snapshot, at CURVE_LR."""
    snap.restore()
    rates = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = CURVE_LR
    try:
        return [train_step(run, opt, b) for b in batches]
    finally:
        for g, lr in zip(opt.param_groups, rates):
            g["lr"] = lr


def curve_max_rel_diff(curve: list[float], ref: list[float]) -> float:
    """The largest relative difference of ``curve`` from ``ref`` at any step."""
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(curve, ref))


def compiles_at_lengths(run, opt: torch.optim.Optimizer, model: nn.Module, s: ModelSettings,
                        lengths: tuple[int, ...], snap: Snapshot) -> dict[str, int]:
    """How many graphs dynamo compiles on one training step at each further sequence length, in order."""
    from torch._dynamo.utils import counters

    out = {}
    for t in lengths:
        snap.restore()
        before = int(counters["stats"]["unique_graphs"])
        train_step(run, opt, _tokens(model, s, t, s.seed))
        out[str(t)] = int(counters["stats"]["unique_graphs"]) - before
    return out


def run_compile_bench(model: nn.Module, s: ModelSettings, progress=None, on_side=None, curve_steps: int = 0,
                      lengths: tuple[int, ...] = (), compiler: str = "inductor",
                      sides: tuple[str, ...] = SIDES, causal_masks: bool = False) -> dict:
    """Per side of ``sides`` (run in SIDES' order), ``s.warmup`` untimed then ``s.steps`` timed training
    steps, ``on_side(side, row)`` as each finishes; then ``curve_steps`` steps on fresh corpus batches
    (CURVE_LR) for its loss curve, and on a compiled side one step at each of ``lengths`` counting the
    graphs each compiles. ``compiler``: torch.compile's backend."""
    unknown = [x for x in sides if x not in SIDES]
    if unknown or not sides:
        raise ValueError(f"sides {unknown or '(none)'}: choose one or more of {', '.join(SIDES)}")

    model.train()
    batch = _tokens(model, s, s.seq_len, s.seed)
    curve_batches = corpus_batches(model, s, curve_steps) if curve_steps else []
    opt = optimizer_for(model, s.lr)
    chosen = [x for x in SIDES if x in sides]
    sides = ModelSides(model, s)
    compiled = torch.compile(model, backend=compiler)
    snap = steady_snapshot(model, opt, batch, sides)
    out: dict = {"tokens_per_step": s.batch_size * s.seq_len, "sides": {}}
    for side in chosen:
        patched, is_compiled = side.startswith("patched"), side.endswith("compiled")
        run = compiled if is_compiled else model
        if causal_masks and (masks := causal_only_masks(model)) is not None:
            # The bench's batches are whole unpadded rows: the mapping the eager mask code computes.
            run = functools.partial(run, attention_mask=masks)
        fresh_counts(compile_from_scratch=is_compiled)      # a compiled side's first step: its compile time
        # (on CPU the unpatched side runs reference cores, which no wrapper picks)
        own_kernels = is_compiled and not patched and not sides.reference
        kernels = installed_kernels_under_compile() if own_kernels else contextlib.nullcontext(False)
        with sides.enter("patched" if patched else "unpatched"), kernels as held:
            ms, losses, peak = [], [], 0.0
            first_ms = None
            for i in range(s.warmup + s.steps):
                elapsed, loss, step_peak = timed_step(run, opt, batch, snap, s.device)
                first_ms = elapsed if first_ms is None else first_ms
                if step_peak is not None:
                    peak = max(peak, step_peak)
                losses.append(loss)
                if i >= s.warmup:
                    ms.append(elapsed)
                if progress is not None:
                    progress(f"{side}: step {i + 1}/{s.warmup + s.steps}")
            row = step_summary(ms, out["tokens_per_step"])
            row.update(peak_mb=peak if s.device == "cuda" else None, loss=losses,
                       compile_s=(first_ms - row["median_step_ms"]) / 1e3 if is_compiled else None,
                       dispatch=dispatch_report())
            if is_compiled:
                row.update(dynamo_counts())
            if held:
                row["core_under_compile"] = HELD_KERNELS
            if s.device == "cuda":
                snap.restore()
                row.update(gpu_time_by_group(lambda: train_step(run, opt, batch)))
            if curve_batches:
                row["curve_loss"] = loss_curve(run, opt, curve_batches, snap)
                if progress is not None:
                    progress(f"{side}: {curve_steps} loss-curve steps", curve_steps)
            if is_compiled and lengths:
                row["graphs_compiled_at_length"] = compiles_at_lengths(run, opt, model, s, lengths, snap)
                if progress is not None:
                    progress(f"{side}: one step at each of {len(lengths)} further lengths", len(lengths))
        out["sides"][side] = row
        if on_side is not None:
            on_side(side, row)
    unpatch_model(model)
    if curve_batches:
        out["curve"] = {"steps": curve_steps, "lr": CURVE_LR, "batches": CURVE_BATCHES}
    summarize(out)
    return out


def summarize(out: dict) -> None:
    """Each side's speed-up and loss differences against unpatched eager, and patched compiled against
    unpatched compiled, where those sides are in ``out["sides"]``."""
    base = out["sides"].get("unpatched eager")
    for row in out["sides"].values():
        for key in ("speedup_vs_unpatched_eager", "first_loss_rel_diff", "curve_max_rel_diff"):
            row.pop(key, None)
        if base is None:
            continue
        row["speedup_vs_unpatched_eager"] = base["median_step_ms"] / row["median_step_ms"]
        row["first_loss_rel_diff"] = abs(row["loss"][0] - base["loss"][0]) / max(abs(base["loss"][0]), 1e-30)
        if "curve_loss" in row and "curve_loss" in base:
            row["curve_max_rel_diff"] = curve_max_rel_diff(row["curve_loss"], base["curve_loss"])
    out.pop("speedup_vs_unpatched_compiled", None)
    if "unpatched compiled" in out["sides"] and "patched compiled" in out["sides"]:
        out["speedup_vs_unpatched_compiled"] = (out["sides"]["unpatched compiled"]["median_step_ms"]
                                                / out["sides"]["patched compiled"]["median_step_ms"])


def compile_problems(res: dict) -> list[str]:
    """Why a four-sided result does not show rewy at work, if it does not (empty: it does)."""
    problems = []
    for side in ("patched eager", "patched compiled"):
        if side in res["sides"] and total_calls(res["sides"][side]["dispatch"], "optimized_backward_calls") == 0:
            problems.append(f"the {side} side ran no optimized backward")
    if any(not all(x == x and abs(x) != float("inf") for x in r["loss"]) for r in res["sides"].values()):
        problems.append("a loss was not finite")
    return problems
