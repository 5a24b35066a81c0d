"""`rewy-hf bench --model X --compile`: one training step, four ways, on the same weights.

The sides are unpatched eager, unpatched compiled, patched eager and patched
compiled (``torch.compile`` with its defaults: inductor, automatic dynamic
shapes). They run one after the other on the one model instance, each from the
same weights and optimizer state (restored before every step, outside the
timing). A compiled side's first step includes tracing and compiling; its
compile time is that step's wall time less the side's median step. Per side:
the median step, tokens/s, peak memory, the compile time, dynamo's graph
breaks and compiled graphs, and one profiled step's GPU time by kernel family
(the delta-rule core, GEMMs, elementwise and copies, the short convolution,
attention, the optimizer), so what is left after compiling is visible.

Unlike the two-sided bench (model_bench.py), the sides do not alternate step by
step: every switch between a compiled patched and unpatched model would re-run
dynamo's guards on the swapped functions, and the four blocks keep each
compiled graph warm.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn as nn

from ..patching.dispatch import dispatch_report, reset_dispatch_report, total_calls
from ..patching.patch import unpatch_model
from .model_bench import ModelSettings, ModelSides, Snapshot, timed_step, train_step
from .model_profile import DELTA_RULE

SIDES = ("unpatched eager", "unpatched compiled", "patched eager", "patched compiled")
FAMILIES = ("core", "gemm", "elementwise", "conv", "attention", "optimizer")


def kernel_family(name: str) -> str:
    """The family of a GPU kernel, by its name."""
    n = name.lower()
    if any(n.startswith(x) or x in n for x in DELTA_RULE):
        return "core"
    if any(x in n for x in ("adam", "multi_tensor_apply", "foreach")):
        return "optimizer"
    if any(x in n for x in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(x in n for x in ("conv", "fprop", "dgrad", "wgrad")):
        return "conv"
    if any(x in n for x in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")):
        return "gemm"
    return "elementwise"


def gpu_time_by_family(step) -> tuple[float, dict[str, float], int]:
    """(summed kernel ms, ms per family, kernel launches) of one call of ``step`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per = dict.fromkeys(FAMILIES, 0.0)
    launches = 0
    for e in prof.events():
        if e.device_type.name == "CUDA" and "Memset" not in e.name:
            per[kernel_family(e.name)] += (e.time_range.end - e.time_range.start) / 1000.0
            launches += 1
    return sum(per.values()), per, launches


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "break_reasons": sorted(counters["graph_break"])[:20]}


def run_compile_bench(model: nn.Module, s: ModelSettings, progress=None, on_side=None) -> dict:
    """Per side of SIDES, ``s.warmup`` untimed then ``s.steps`` timed training steps; see the module
    docstring. ``on_side(side, row)`` is called as each side finishes."""
    import torch._dynamo

    model.train()
    batch = torch.randint(0, model.config.vocab_size, (s.batch_size, s.seq_len),
                          generator=torch.Generator().manual_seed(s.seed)).to(s.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    sides = ModelSides(model, s)
    compiled = torch.compile(model)
    initial = Snapshot(model, opt)
    with sides.enter("unpatched"):
        train_step(model, opt, batch)           # creates AdamW's state: every timed step is a steady-state step
    snap = Snapshot(model, opt)
    snap.weights = initial.weights
    del initial

    out: dict = {"tokens_per_step": s.batch_size * s.seq_len, "sides": {}}
    for side in SIDES:
        patched, is_compiled = side.startswith("patched"), side.endswith("compiled")
        run = compiled if is_compiled else model
        if is_compiled:
            torch._dynamo.reset()           # each compiled side compiles from scratch: its compile time
        torch._dynamo.utils.counters.clear()
        reset_dispatch_report()
        with sides.enter("patched" if patched else "unpatched"):
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
            med = statistics.median(ms)
            row = {"step_ms": ms, "median_step_ms": med, "tokens_per_s": out["tokens_per_step"] / med * 1e3,
                   "peak_mb": peak if s.device == "cuda" else None, "loss": losses,
                   "compile_s": (first_ms - med) / 1e3 if is_compiled else None,
                   "dispatch": dispatch_report()}
            if is_compiled:
                row.update(_dynamo_counts())
            if s.device == "cuda":
                snap.restore()
                total, per, launches = gpu_time_by_family(lambda: train_step(run, opt, batch))
                row.update(gpu_ms=total, gpu_ms_by_family=per, launches=launches)
        out["sides"][side] = row
        if on_side is not None:
            on_side(side, row)
    unpatch_model(model)
    base = out["sides"]["unpatched eager"]
    for side, row in out["sides"].items():
        row["speedup_vs_unpatched_eager"] = base["median_step_ms"] / row["median_step_ms"]
        row["first_loss_rel_diff"] = abs(row["loss"][0] - base["loss"][0]) / max(abs(base["loss"][0]), 1e-30)
    out["speedup_vs_unpatched_compiled"] = (out["sides"]["unpatched compiled"]["median_step_ms"]
                                            / out["sides"]["patched compiled"]["median_step_ms"])
    return out


def compile_problems(res: dict) -> list[str]:
    """Why a four-sided result does not show rewy at work, if it does not (empty: it does)."""
    problems = []
    for side in ("patched eager", "patched compiled"):
        if total_calls(res["sides"][side]["dispatch"], "optimized_backward_calls") == 0:
            problems.append(f"the {side} side ran no optimized backward")
    if any(not all(x == x and abs(x) != float("inf") for x in r["loss"]) for r in res["sides"].values()):
        problems.append("a loss was not finite")
    return problems


def format_side(side: str, r: dict) -> str:
    """One side's line, as it finishes."""
    per = r.get("gpu_ms_by_family") or {}
    fams = ", ".join(f"{f} {per[f]:.1f}" for f in FAMILIES) if per else ""
    comp = f", compile {r['compile_s']:.1f} s, {r.get('graph_breaks')} graph breaks, {r.get('graphs')} graphs" \
        if r["compile_s"] is not None else ""
    peak = f", peak {r['peak_mb']:.0f} MB" if r["peak_mb"] is not None else ""
    return (f"{side}: {r['median_step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s{peak}{comp}"
            + (f"; GPU ms by family: {fams}" if fams else ""))


def format_compile_result(res: dict, spec: str) -> str:
    fam = "  ".join(f"{f:>11}" for f in FAMILIES)
    lines = [f"{spec}: {res['tokens_per_step']} tokens per step",
             f"{'side':<20} {'step ms':>8} {'tokens/s':>9} {'x eager':>8} {'peak MB':>8} {'compile s':>9} "
             f"{'breaks':>6} {'graphs':>6}   GPU ms by family: {fam}"]
    for side, r in res["sides"].items():
        per = r.get("gpu_ms_by_family") or {}
        fams = "  ".join(f"{per.get(f, 0.0):11.2f}" for f in FAMILIES) if per else ""
        peak = f"{r['peak_mb']:8.0f}" if r["peak_mb"] is not None else f"{'-':>8}"
        comp = f"{r['compile_s']:9.1f}" if r["compile_s"] is not None else f"{'-':>9}"
        lines.append(f"{side:<20} {r['median_step_ms']:8.1f} {r['tokens_per_s']:9.0f} "
                     f"{r['speedup_vs_unpatched_eager']:8.3f} {peak} {comp} {r.get('graph_breaks', '-'):>6} "
                     f"{r.get('graphs', '-'):>6}   {fams}")
    lines.append(f"patched compiled vs unpatched compiled: {res['speedup_vs_unpatched_compiled']:.3f}x")
    return "\n".join(lines)
