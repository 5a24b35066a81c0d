"""The reverse state pass split along the sequence: segments walked at once, then joined exactly.

The reverse pass carries the state gradient back one chunk at a time,

    dS_{c-1} = M_c^T dS_c + R_c

(M_c: chunk c's state map; R_c: its query and local-value terms), and every output of the pass
(dh per chunk, dv2 per token, dh0) is affine in the gradient that enters at the sequence's end.
So a segment walked from an end gradient E arrives at its start with

    dS_start = P + T E

where P is the same walk started from zero and T = (M_first ... M_last)^T its K x K map. The
split pass runs in three steps:

1. every segment walked from the wide start [0 | I] with K more value columns whose dO and local
   dv are zero: the first V columns of the gradient reaching its start are P, the last K are T.
   One launch of the family's own walk at width V + K, all segments at once.
2. the end gradients, last segment to first: E of a sequence's last segment is its dht (or zero),
   E_{s-1} = P_s + T_s E_s. One small batched product per segment position.
3. every segment walked again from its E, at width V: dh, dv2 and dh0 as the whole sequence's
   walk writes them (each segment's chunks are those chunks of the whole sequence, numbered alike,
   segments.py).

That is about three walks' work (two when K is small beside V) where the sequential pass does one,
in NS / N times as many programs, each NS / N times shorter. It gains only where the sequential
launch leaves most SMs idle (few sequences x heads), which ``plan`` decides from the shapes; its
rule and measurements are in docs/performance.md.

Precision: P and T come back in float32 (the walk's dh0 output), and step 3 starts each segment
from its float32 E, as the sequential walk carries its float32 gradient across the same chunk
bound; each walk rounds the gradient to the inputs' dtype for its products as it does anyway.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
import triton

from ..constants import CHUNK
from .chunks import host_bounds
from .occupancy import sm_count
from .segments import Segments, cut, row_bounds

# Where the sequential walk at its narrowest value block (16 columns) has fewer programs than a quarter
# of the SMs; segments of at least MIN_CHUNKS chunks, about PROGRAMS_PER_SM programs per SM in step 3.
NARROW = 16
MIN_CHUNKS = 64
PROGRAMS_PER_SM = 1


def chunks_per_segment(sequence_chunks: list[int], value_heads: int, V: int, sms: int) -> int | None:
    """L, the chunks per segment of the split pass, or None for the sequential walk."""
    programs = len(sequence_chunks) * value_heads * triton.cdiv(V, NARROW)
    if 4 * programs >= sms:
        return None
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    return max(MIN_CHUNKS, triton.cdiv(max(sequence_chunks, default=0), wanted))


def plan(do: torch.Tensor, cu_seqlens: torch.Tensor | None) -> Segments | None:
    """The segments of the split pass for dO [B, T, HV, V], or None for the sequential walk. Decided
    from the shapes where they suffice (a packed call's lengths are read only where they matter)."""
    B, T, HV, V = do.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    sms = sm_count(do)
    if chunks_per_segment([0] * N, HV, V, sms) is None:
        return None
    bounds = row_bounds(B, T) if cu_seqlens is None else host_bounds(cu_seqlens)
    L = chunks_per_segment([triton.cdiv(e - b, CHUNK) for b, e in zip(bounds[:-1], bounds[1:])], HV, V, sms)
    if L is None:
        return None
    segments = cut(bounds, L, do.device)
    return segments if segments.cuts else None


@lru_cache(maxsize=64)
def _positions(per_sequence: tuple[int, ...], device: torch.device):
    """(index [depth x sequences]: the segments by position, each sequence's last segment at the last
    position, NS (a zero row) where a sequence has fewer segments; each segment's place in that index)."""
    depth, count = max(per_sequence), sum(per_sequence)
    index = torch.full((depth, len(per_sequence)), count, dtype=torch.long)
    place = torch.empty(count, dtype=torch.long)
    first = 0
    for n, m in enumerate(per_sequence):
        index[depth - m:, n] = torch.arange(first, first + m)
        place[first:first + m] = torch.arange(depth - m, depth) * len(per_sequence) + n
        first += m
    return index.flatten().to(device), place.to(device)


@lru_cache(maxsize=16)
def _wide_start(count: int, HV: int, K: int, V: int, device: torch.device) -> torch.Tensor:
    """[0 | I]: the gradient each segment's wide walk starts from (read, never written: kept)."""
    start = torch.zeros(count, HV, K, V + K, device=device)
    start[..., V:] = torch.eye(K, device=device)
    return start


def end_gradients(reached: torch.Tensor, V: int, segments: Segments, dht: torch.Tensor | None) -> torch.Tensor:
    """Step 2: E [NS, HV, K, V], the gradient entering each segment at its end (K-first, float32), from
    what the wide walk reached, [P | T] [NS, HV, K, V + K], and the sequences' dht [N, HV, K, V]."""
    index, place = _positions(segments.per_sequence, reached.device)
    NS, HV, K, _ = reached.shape
    rows = len(segments.per_sequence) * HV
    # One zero row past the segments: a sequence with fewer segments has P = T = 0 at the positions
    # before its first, so E there is 0 (never read). The host issues one product per position and
    # little else: with few heads this step is launch-bound.
    PT = torch.cat([reached, reached.new_zeros(1, HV, K, V + K)]).index_select(0, index).view(-1, rows, K, V + K)
    P, T = PT[..., :V].unbind(0), PT[..., V:].unbind(0)
    E = reached.new_empty(len(P), rows, K, V)
    ends = E.unbind(0)
    if dht is None:
        ends[-1].zero_()
    else:
        torch.index_select(dht.float(), 0, segments.sequences, out=ends[-1].view(-1, HV, K, V))
    for p in range(len(ends) - 1, 0, -1):
        torch.baddbmm(P[p], T[p], ends[p], out=ends[p - 1])
    return E.view(-1, HV, K, V).index_select(0, place)


def reverse(walk, segments: Segments, inputs: dict, do: torch.Tensor, dv: torch.Tensor, dht, h0,
            state_v_first: bool = False):
    """dh, dh0, dv2 of the whole sequences' reverse pass, computed by the split pass.

    ``walk(do=, dv=, h0=, dht=, cu_seqlens=, chunk_indices=, state_v_first=, **inputs)`` is the
    family's sequential pass (rewy's walk or FLA's ``bwd_dhu``), returning (dh, dh0, dv2);
    ``inputs``: its per-token tensors [B, T, ...] (q, k, w and the gate), None where absent;
    do, dv [B, T, HV, V]; dht [N, HV, ...] and h0 in the state layout the walk runs in
    (V-first where ``state_v_first``); dh0 is returned where h0 is given."""
    B, T, HV, V = do.shape
    K = inputs["k"].shape[-1]
    joined = lambda x: x.reshape(1, B * T, *x.shape[2:])
    tokens = {n: joined(x) for n, x in inputs.items() if x is not None}
    on_segments = dict(cu_seqlens=segments.cu_seqlens, chunk_indices=segments.chunk_indices)

    # Step 1: the value columns from zero, the K map columns from the identity (their dO and dv zero).
    start = _wide_start(segments.count, HV, K, V, do.device)
    _, reached, _ = walk(do=F.pad(joined(do), (0, K)), dv=F.pad(joined(dv), (0, K)), h0=start, dht=start,
                         state_v_first=False, **on_segments, **tokens)

    k_first = lambda x: None if x is None else (x.transpose(-1, -2) if state_v_first else x)
    E = k_first(end_gradients(reached, V, segments, k_first(dht))).contiguous()
    del reached

    # Step 3: every segment from its exact end gradient.
    dh, starts, dv2 = walk(do=joined(do), dv=joined(dv), h0=E, dht=E, state_v_first=state_v_first, **on_segments,
                           **tokens)
    dh0 = None
    if h0 is not None:
        # an empty packed sequence has no segment: its gradient passes through, as in the sequential walk
        dh0 = torch.zeros_like(h0, dtype=torch.float32) if dht is None else dht.float().clone()
        dh0.index_copy_(0, segments.sequences, starts.index_select(0, segments.sequence_starts))
    return dh.view(B, -1, *dh.shape[2:]), dh0, dv2.view(do.shape)
