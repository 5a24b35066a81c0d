"""Model-level `rewy-hf bench --model`: one whole training step, unpatched vs patched.

A step is forward + loss backward + AdamW step + zero_grad. Both sides are the
same model instance (``patch_model`` / ``unpatch_model`` switch it), fed the
same batch, and start every step from the same weights and optimizer state
(restored in place before each step, outside the timing), so neither side's
optimizer updates drift the other's inputs. The sides alternate step by step
and swap which goes first every step, so slow drift of the machine (clocks,
allocator) is shared.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from .bench_timing import sync
from .dispatch import dispatch_report, reset_dispatch_report
from .patching import patch_model, unpatch_model
from .reference_cores import needs_reference_cores, use_reference_cores

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


class _Snapshot:
    """Weights and optimizer state, restored in place (the optimizer keeps its references)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer):
        self.model, self.opt = model, opt
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.state = {p: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
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


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


class _Sides:
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
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    sides = _Sides(model, s)

    # One untimed step creates the optimizer state, so every later step is a
    # steady-state step (no first-step allocation of AdamW's moments).
    initial_weights = _Snapshot(model, opt)
    with sides.enter("unpatched"):
        _train_step(model, opt, batch)
    snap = _Snapshot(model, opt)
    snap.weights = initial_weights.weights
    del initial_weights

    ms = {side: [] for side in SIDES}
    peak = {side: [] for side in SIDES}
    losses = {side: [] for side in SIDES}
    for i in range(s.warmup + s.steps):
        if i == s.warmup:
            reset_dispatch_report()    # count only the timed steps
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        for side in order:
            with sides.enter(side):
                snap.restore()
                sync(s.device)
                if s.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                loss = _train_step(model, opt, batch)
                sync(s.device)
                elapsed = (time.perf_counter() - t0) * 1e3
            if i >= s.warmup:
                ms[side].append(elapsed)
                losses[side].append(loss)
                if s.device == "cuda":
                    peak[side].append((torch.cuda.max_memory_allocated() - base) / 2**20)
        if progress is not None:
            progress(f"step {i + 1}/{s.warmup + s.steps}" + (" (warm-up)" if i < s.warmup else ""))
    unpatch_model(model)
    tokens = s.batch_size * s.seq_len
    out: dict = {"tokens_per_step": tokens, "reference_cores_unpatched": sides.reference}
    for side in SIDES:
        med = statistics.median(ms[side])
        out[side] = {"step_ms": ms[side], "median_step_ms": med, "tokens_per_s": tokens / med * 1e3,
                     "peak_mb": max(peak[side]) if peak[side] else None, "loss": losses[side]}
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
