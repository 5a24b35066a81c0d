"""Model-level `rewy-hf bench --model`: one whole training step (forward, loss backward, AdamW step,
zero_grad), unpatched against patched on the same model instance, from the same weights and optimizer
state before every step; the sides alternate and swap which goes first every step."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..patching.dispatch import dispatch_report, reset_dispatch_report
from ..patching.patch import patch_model, unpatch_model
from ..patching.reference_cores import needs_reference_cores, use_reference_cores
from .timing import sync

SIDES = ("unpatched", "patched")


@dataclass
class ModelSettings:
    device: str
    steps: int
    warmup: int
    batch_size: int
    seq_len: int
    backend: str
    policy: str
    seed: int
    lr: float = 1e-5


class Snapshot:
    """Weights and optimizer state, restored in place (the optimizer keeps its references)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, on: str | None = None):
        """``on``: where the copies live (default: beside the originals); "cpu" leaves a large model's
        GPU memory to the steps."""
        self.model, self.opt = model, opt

        def copy(v: torch.Tensor) -> torch.Tensor:
            return v.detach().clone() if on is None else v.detach().to(on, copy=True)

        self.weights = {k: copy(v) for k, v in model.state_dict().items()}
        self.state = {p: {k: (copy(v) if torch.is_tensor(v) else v) for k, v in s.items()}
                      for p, s in opt.state.items()}

    @torch.no_grad()
    def restore(self) -> None:
        self.model.load_state_dict(self.weights)
        for p, saved in self.state.items():
            for k, v in saved.items():
                if torch.is_tensor(v):
                    self.opt.state[p][k].copy_(v)
                else:
                    self.opt.state[p][k] = v


def optimizer_for(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The bench's AdamW: fused, one kernel over all parameters, as transformers' Trainer defaults to
    (``adamw_torch_fused``) and the recipe uses."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=True)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor | dict) -> float:
    """One step on ``batch``: token ids (their own labels), or a packed row's inputs by name."""
    # No cache: a training step needs none, and building one (transformers' models do when the
    # config says use_cache) adds state writes and, under torch.compile, recompiles.
    inputs = batch if isinstance(batch, dict) else {"input_ids": batch, "labels": batch}
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def steady_snapshot(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor,
                    sides: "ModelSides") -> Snapshot:
    """The weights before any step, with the optimizer state after one untimed unpatched step: every
    timed step is then a steady-state step (no first-step allocation of AdamW's moments)."""
    initial = Snapshot(model, opt)
    with sides.enter("unpatched"):
        train_step(model, opt, batch)
    snap = Snapshot(model, opt)
    snap.weights = initial.weights
    return snap


def step_summary(ms: list[float], tokens: int) -> dict:
    med = statistics.median(ms)
    return {"step_ms": ms, "median_step_ms": med, "tokens_per_s": tokens / med * 1e3}


def timed_step(run, opt: torch.optim.Optimizer, batch: torch.Tensor, snap: Snapshot, device: str):
    """(ms, loss, peak MB above what was allocated before, None off CUDA) of one training step of
    ``run`` from the snapshot's weights and optimizer state (restored outside the timing)."""
    snap.restore()
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loss = train_step(run, opt, batch)
    sync(device)
    elapsed = (time.perf_counter() - t0) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
    return elapsed, loss, peak


class ModelSides:
    """Switches the one model instance between its unpatched and patched self."""

    def __init__(self, model: nn.Module, s: ModelSettings):
        self.model, self.s = model, s
        self.patch_report = None
        # On CPU the original delta-rule cores cannot run (transformers' dispatches
        # to FLA's Triton op, FLA layers are Triton-only): the unpatched side runs
        # the reference cores that `rewy-hf parity` uses there.
        self.reference = needs_reference_cores(model)

    def enter(self, side: str) -> contextlib.AbstractContextManager:
        if side == "patched":
            report = patch_model(self.model, backend=self.s.backend, policy=self.s.policy)
            self.patch_report = self.patch_report or report
            return contextlib.nullcontext()
        unpatch_model(self.model)
        return use_reference_cores(self.model) if self.reference else contextlib.nullcontext()


def run_model_bench(model: nn.Module, s: ModelSettings, progress=None) -> dict:
    """Time ``s.steps`` training steps per side after ``s.warmup`` untimed ones; see the module docstring."""
    model.train()
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (s.batch_size, s.seq_len), generator=torch.Generator().manual_seed(s.seed))
    batch = batch.to(s.device)
    opt = optimizer_for(model, s.lr)
    sides = ModelSides(model, s)
    snap = steady_snapshot(model, opt, batch, sides)
    ms = {side: [] for side in SIDES}
    peak = {side: [] for side in SIDES}
    losses = {side: [] for side in SIDES}
    for i in range(s.warmup + s.steps):
        if i == s.warmup:
            reset_dispatch_report()    # count only the timed steps
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        for side in order:
            with sides.enter(side):
                elapsed, loss, step_peak = timed_step(model, opt, batch, snap, s.device)
            if i >= s.warmup:
                ms[side].append(elapsed)
                losses[side].append(loss)
                if step_peak is not None:
                    peak[side].append(step_peak)
        if progress is not None:
            progress(f"step {i + 1}/{s.warmup + s.steps}" + (" (warm-up)" if i < s.warmup else ""))
    unpatch_model(model)
    tokens = s.batch_size * s.seq_len
    out: dict = {"tokens_per_step": tokens, "reference_cores_unpatched": sides.reference}
    for side in SIDES:
        out[side] = {**step_summary(ms[side], tokens), "peak_mb": max(peak[side]) if peak[side] else None,
                     "loss": losses[side]}
    out["speedup"] = out["unpatched"]["median_step_ms"] / out["patched"]["median_step_ms"]
    u, p = losses["unpatched"][0], losses["patched"][0]
    out["loss_rel_diff"] = abs(p - u) / max(abs(u), 1e-30)
    out["losses_finite"] = all(math.isfinite(x) for side in SIDES for x in losses[side])
    out["patch_report"] = sides.patch_report.to_dict() if sides.patch_report else None
    out["patched_layers"] = len(sides.patch_report) if sides.patch_report else 0
    out["dispatch"] = dispatch_report()
    ops = out["dispatch"]["ops"].values()
    out["optimized_backward_calls"] = sum(e["optimized_backward_calls"] for e in ops)
    out["fallback_calls"] = sum(e["fallback_calls"] for e in ops)
    return out


def describe_model_run(spec: str, s: ModelSettings, dtype: str, gdn_guard: dict) -> dict:
    """The settings record of a model-level run, with the sentences that say how it times."""
    return {"model": spec, "device": s.device, "dtype": dtype, "batch_size": s.batch_size, "seq_len": s.seq_len,
            "steps": s.steps, "warmup": s.warmup, "backend": s.backend, "policy": s.policy,
            "optimizer": f"AdamW(lr={s.lr:g}, fused)", "seed": s.seed, "gdn_guard": gdn_guard,
            "timing": "time.perf_counter around one full step (device synchronised before and after); "
                      "weights and optimizer state restored before every step, outside the timing; sides "
                      "alternate and swap order every step",
            "peak_memory": "torch.cuda.max_memory_allocated during the step minus what was allocated before "
                           "it (weights, optimizer state, the restore snapshot)"}


def model_problems(res: dict) -> list[str]:
    """Why a model-level result does not show rewy at work, if it does not (empty: it does)."""
    problems = []
    if res["patched_layers"] == 0:
        problems.append("no layer was patched")
    if res["optimized_backward_calls"] == 0:
        problems.append("the patched side ran no optimized backward (its layers never reached the chunked core; "
                        "FLA's DeltaNet uses a recurrent kernel for sequences of 64 tokens or fewer: raise --seq-len)")
    if not res["losses_finite"]:
        problems.append("a loss was not finite")
    return problems
