"""Every kernel build a packed call can need, compiled and tuned at its configuration's first packed call.

Which kernels a packed call launches, and how each is specialised, depends on
its packing, not only on the shapes:

- one sequence of few value heads runs the state walks at the narrow value
  block (``state_launch.narrow_block_v``), a kernel of its own;
- where the sequential state walk fills less than half the SMs, the forward
  keeps state checkpoints, and where some document is longer than a segment
  the backward rebuilds the states from them (``state_checkpoints``), a launch
  with initial states, narrow or not by the number of segments;
- chunk kernels run their full chunks and their short ones (a document's last,
  partial chunk) as two launches of two builds (``chunks.chunk_launches``).

A build is compiled and tuned the first time a step's packing needs it. In a
long packed run that is whenever a rare packing first comes, a row that holds
one long document for instance, and that step then waits for Triton. On an
H100, step 7 of a 50-step run of qwen3.5-gva-1b-248k (rows of 8,192 tokens)
took 16.2 s against a 334 ms median, its row being the run's first with a
single document.

So the first packed call of a configuration (gate kind, head counts and
dims, dtypes, policy, options, the size class of T, the device) also runs the
forward and the backward on its own tensors under a few other packings of its
T tokens (``representatives``), until every build that packings of T tokens
need has run once. Later steps find them all built and tuned. The cost, one
forward and backward of the core per added packing (one to three at the
presets' shapes), is paid once per process and configuration, in the first
step.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from itertools import accumulate
from typing import Callable

import torch
import triton

from ..constants import CHUNK
from ..core_args import CoreArgs
from .chunks import host_bounds
from .occupancy import fills_half, sm_count
from .state_checkpoints import chunks_per_segment
from .state_launch import narrow_block_v
from .tiles import size_class

_prepared: set = set()


def builds(bounds: tuple[int, ...], value_heads: int, V: int, sms: int) -> frozenset:
    """The kernel builds of a packed call's launches that follow from its packing (token ``bounds``,
    cu_seqlens on the host): the state walks' width (narrow or not), the backward's state rebuild
    (sequential, or from checkpoints over segments) and its width, and which chunk launches run
    (over full chunks, over short ones)."""
    lengths = [e - b for b, e in zip(bounds[:-1], bounds[1:])]
    chunks = [triton.cdiv(n, CHUNK) for n in lengths]
    narrow = lambda sequences: narrow_block_v(sequences, value_heads, V) is not None
    out = {("walk", narrow(len(lengths)))}
    L = chunks_per_segment(chunks, value_heads, V, sms)
    segments = len(lengths) if L is None else sum(triton.cdiv(c, L) for c in chunks)
    if L is None or segments == sum(1 for c in chunks if c):
        out.add(("rebuild", "sequential", narrow(len(lengths))))
    else:
        out.add(("rebuild", "segments", narrow(segments)))
    if any(n >= CHUNK for n in lengths):
        out.add(("chunks", "full"))
    if any(n % CHUNK for n in lengths):
        out.add(("chunks", "short"))
    return frozenset(out)


def _patterns(T: int, n: int):
    """Some packings of T tokens into n documents (lengths), the shapes that reach the builds:
    equal documents, equal whole chunks, and one long document beside n - 1 short ones."""
    yield [T // n] * (n - 1) + [T - (n - 1) * (T // n)]
    whole = (T // n) // CHUNK * CHUNK
    if whole:
        yield [whole] * (n - 1) + [T - (n - 1) * whole]
    for short in (1, CHUNK, CHUNK + 1):
        if (n - 1) * short < T:
            yield [short] * (n - 1) + [T - (n - 1) * short]


@lru_cache(maxsize=64)
def representatives(T: int, value_heads: int, V: int, sms: int) -> tuple[tuple[int, ...], ...]:
    """Packings (token bounds) of T tokens whose ``builds`` together are every build that packings of
    T tokens reach, each adding some build the ones before it lack. From the first count of
    documents that fills half the SMs and is not narrow on, a count changes neither the walks'
    width nor the checkpoints, so the search stops there."""
    found, covered = [], set()
    for n in range(1, T + 1):
        for lengths in _patterns(T, n):
            bounds = tuple(accumulate(lengths, initial=0))
            new = builds(bounds, value_heads, V, sms) - covered
            if new:
                found.append(bounds)
                covered |= new
        if fills_half(n, value_heads, V, sms) and narrow_block_v(n, value_heads, V) is None:
            break
    return tuple(found)


def configuration(stages, a: CoreArgs) -> tuple:
    """What, besides the packing, decides which kernels a call builds and how they are tuned: T
    counts by its size class (the tuning key) and whether 16 divides it (Triton specialises
    integer arguments on that)."""
    kind = lambda x: None if x is None else (x.dtype, x.dim())
    T = a.q.shape[1]
    return (stages, a.q.device, a.q.shape[2:], a.v.shape[2:], size_class(triton.cdiv(T, CHUNK)), T % 16 == 0,
            kind(a.q), kind(a.k), kind(a.v), kind(a.g), kind(a.beta), kind(a.w), kind(a.h0),
            a.policy, a.state_v_first, a.qk_l2norm, a.safe_gate)


def prepare(stages, a: CoreArgs, forward: Callable, backward: Callable) -> None:
    """At a configuration's first packed call, run ``forward`` and ``backward`` once for each
    representative packing that adds a build the call's own packing and the ones run before
    lack (the results are dropped). Not while a CUDA graph is being captured: a graph's launches
    must all be its own."""
    if a.cu_seqlens is None or (a.v.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    key = configuration(stages, a)
    if key in _prepared:
        return
    _prepared.add(key)              # first: the calls below are packed calls of this configuration
    HV, V = a.v.shape[2:]
    sms = sm_count(a.v)
    covered = set(builds(host_bounds(a.cu_seqlens), HV, V, sms))
    with torch.no_grad():
        for bounds in representatives(a.q.shape[1], HV, V, sms):
            new = builds(bounds, HV, V, sms) - covered
            if not new:
                continue
            covered |= new
            b = dataclasses.replace(a, cu_seqlens=torch.tensor(bounds, dtype=a.cu_seqlens.dtype,
                                                               device=a.cu_seqlens.device))
            if a.h0 is not None:
                b.h0 = a.h0.new_zeros(len(bounds) - 1, *a.h0.shape[1:])
            o, _, saved = forward(stages, b)
            backward(stages, b, saved, o, None)
