"""Timing and peak memory for the op-level bench: the two boundaries, alternating rounds."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, ContextManager

import torch


def leaves(inputs) -> list[torch.Tensor]:
    return [x.detach().requires_grad_() for x in inputs]


def describe(exc: BaseException) -> str:
    """The first line of an error, short enough for a table note."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


Scope = Callable[[], ContextManager]


def runner(boundary: str, fn: Callable, inputs, do, scope: Scope = contextlib.nullcontext) -> Callable[[], None]:
    """One timed unit. FB: a forward and its backward. B: one backward through a
    forward graph built here, outside the timing (retain_graph keeps its saved
    tensors for the next run; a recompute policy recomputes inside each run).
    ``scope``: a context that every forward and backward of the side runs in."""
    xs = leaves(inputs)
    if boundary == "FB":
        def run():
            with scope():
                torch.autograd.grad(fn(*xs), xs, do)
        return run
    with scope():
        o = fn(*xs)

    def run_backward():
        with scope():
            torch.autograd.grad(o, xs, do, retain_graph=True)
    return run_backward


def time_once(run: Callable[[], None], device: str, rep_ms: float) -> float:
    if device == "cuda":
        import triton.testing

        # One round: a do_bench median over rep_ms of runs (it flushes the L2 cache between runs).
        return float(triton.testing.do_bench(run, warmup=1, rep=rep_ms, return_mode="median"))
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3


def measure(runners: dict[str, Callable[[], None]], device: str, warmup: int, reps: int,
            rep_ms: float) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``warmup`` untimed runs, then ``reps`` rounds, the sides alternating within
    each, so drift of the machine over the run is shared. A side that raises
    drops out with its reason: (samples per side, errors per side)."""
    alive, errors = dict(runners), {}
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(warmup + reps):
        for name, run in list(alive.items()):
            try:
                if i < warmup:
                    run()
                    sync(device)
                else:
                    samples[name].append(time_once(run, device, rep_ms))
            except Exception as exc:
                errors[name] = describe(exc)
                del alive[name]
    return {n: v for n, v in samples.items() if n in alive}, errors


def peak_mb(fn: Callable, inputs, do, scope: Scope = contextlib.nullcontext) -> float:
    """Memory one forward + backward adds on top of what is allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    xs = leaves(inputs)
    with scope():
        torch.autograd.grad(fn(*xs), xs, do)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
