"""State checkpoints: the ``recompute`` policy's states rebuilt in parallel along the sequence.

Under ``recompute`` the backward needs h (the state entering every chunk)
again. FLA rebuilds it with its sequential ``fwd_h``: one program per
(sequence, value head, block of value columns) walks all the sequence's
chunks in order. With few sequences x heads and long sequences that walk is
the stage's whole time and leaves most of the GPU idle: 64 programs for 132
SMs at (2, 8192, 16), 0.15 ms of a 1.05 ms GDN backward on the H200.

The forward has just computed h for every chunk. Keeping it at the first
chunk of every segment of L chunks (the checkpoints, NS x HV x K x V values,
a few MB) lets the backward rebuild h with every sequence cut into those
segments, each started from its checkpoint: FLA's own ``fwd_h`` kernel run
on the segments as if they were packed sequences (``cu_seqlens`` at the
segment bounds, the checkpoints as their initial states). Segments start on
chunk bounds of their sequence, so the segmented run numbers its chunks as
the whole-sequence run does, and h and v_new come back in the layout the rest
of the backward reads. It walks the same chunks once, as the sequential
rebuild does, with NS / N times as many programs. Unlike a sequence-parallel
scan, which must first find the boundary states (twice the work), this takes
them from the forward.

Precision: a checkpoint is the forward's h at that chunk in h's dtype (the
value policy ``full`` keeps for every chunk), so from a checkpoint on the
rebuilt states start from the stored state, not from the forward's float32
running one. A sequence's first segment starts from its initial state as
given (float32), or from zero.

Only policy ``recompute`` keeps checkpoints (``full`` keeps every h already),
and only where ``chunks_per_segment`` finds the sequential rebuild starved.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from ..constants import CHUNK
from . import state_launch
from .chunks import host_bounds
from .occupancy import fewest_filling_half, fills_half, launch_fills_half, sm_count

# Segments of at least MIN_CHUNKS chunks, about PROGRAMS_PER_SM programs per SM in all. Both measured on
# the H200: where the rebuild gained, 32 chunks per segment was the fastest or close to it at every shape,
# and 9 segments of 57 chunks at (1, 32768, 32) lost a third of the gain to a second wave of long programs.
PROGRAMS_PER_SM = 8
MIN_CHUNKS = 32


@dataclass(frozen=True)
class Segments:
    """Every sequence cut into segments of ``length`` chunks (its last one shorter).

    cu_seqlens: [NS + 1] token bounds of the segments in the rows-joined layout
    (row b's tokens at b T .. b T + T - 1); chunk_indices: FLA's (segment, chunk)
    table for them; starts: [NS] the joined chunk index of each segment's first
    chunk; sequence_starts: the segment that begins each sequence with tokens, and
    sequences: which sequence that is (an empty packed sequence has no segment)."""

    length: int
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    starts: torch.Tensor
    sequence_starts: torch.Tensor
    sequences: torch.Tensor

    @property
    def count(self) -> int:
        return len(self.starts)

    @property
    def cuts(self) -> bool:
        """Whether some sequence has more than one segment (else the rebuild is the sequential one)."""
        return self.count > len(self.sequence_starts)


def chunks_per_segment(sequence_chunks: list[int], value_heads: int, V: int, sms: int) -> int | None:
    """L, the chunks per segment, or None to keep no checkpoints (``sms``: the GPU's SMs).

    Cut only where the sequential launch (N x HV x V / 64 programs at FLA's widest value
    block) fills less than half the SMs: on the H200 the rebuild from checkpoints was
    slower at every segment length where it gave 128 or more (B x H = 64 to 128 at
    K = V = 128). There, the shortest segments of at least MIN_CHUNKS chunks that give
    about PROGRAMS_PER_SM programs per SM. A sequence of at most L chunks is one segment;
    where every sequence is, nothing is cut (``Segments.cuts``) and the backward keeps the
    sequential rebuild, but the checkpoints are still kept (one state per sequence), so their
    count follows one formula of the shapes at every length (``dense_count``)."""
    if fills_half(len(sequence_chunks), value_heads, V, sms):
        return None
    return max(MIN_CHUNKS, triton.cdiv(sum(sequence_chunks), _wanted_segments(value_heads, V, sms)))


def _wanted_segments(value_heads: int, V: int, sms: int) -> int:
    return triton.cdiv(PROGRAMS_PER_SM * sms, value_heads * triton.cdiv(V, 64))


def dense_count(B, T, value_heads: int, V: int, sms: int):
    """How many checkpoints ``plan`` keeps for an unpacked v [B, T, HV, V]: 0 where the launch
    fills half the SMs (decided by B, HV and V alone), else B x cdiv(NT, L). With a symbolic
    T (the custom op's fake implementation) the count is an expression of T without a branch,
    so a compiled graph holds at every length."""
    if fills_half(B, value_heads, V, sms):
        return 0
    nt = -(-T // CHUNK)
    L = torch.sym_max(MIN_CHUNKS, -(-(B * nt) // _wanted_segments(value_heads, V, sms)))
    return B * -(-nt // L)


def plan(v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> Segments | None:
    """The segments for this call (v: [B, T, HV, V]), or None to keep no checkpoints."""
    if launch_fills_half(v, cu_seqlens):
        return None         # decided from shapes alone: packed lengths are not read (a device sync)
    B, T, HV, V = v.shape
    bounds = tuple(range(0, B * T + 1, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    L = chunks_per_segment([triton.cdiv(e - b, CHUNK) for b, e in zip(bounds[:-1], bounds[1:])], HV, V,
                           sm_count(v))
    return None if L is None else _segments(bounds, L, v.device)


def packed_count(chunks, sequences, value_heads: int, V: int, sms: int):
    """Slots for the checkpoints ``plan`` keeps for ``sequences`` packed sequences of at most
    ``chunks`` chunks in all: where the launch fills half the SMs it keeps none, else at most one
    per MIN_CHUNKS chunks (segments are never shorter) plus one per sequence (its last, partial
    segment); one slot more either way. In a compiled graph the number of sequences is symbolic:
    written without a branch on it and never 0, the count leaves the trace no guard on it (a branch,
    or a size of 0 when the trace's row filled the GPU, would have the first row of fewer sequences
    than ``fewest_filling_half``, one long document say, compile the graph again)."""
    few = torch.sym_min(1, torch.sym_max(0, fewest_filling_half(value_heads, V, sms) - sequences))
    return 1 + (-(-chunks // MIN_CHUNKS) + sequences) * few


def kept(h: torch.Tensor, h0: torch.Tensor | None, segments: Segments | None, size: int):
    """What the forward saves: ``save``'s checkpoints flattened to one dimension (empty without
    segments), ``size`` values long (rows: ``dense_count``'s exact count; packed calls:
    ``packed_count``'s slots, the values past the checkpoints zero and not read). Flat, their one
    size is a multiple of HV x K x V, never 0 or 1 at any length, so a compiled graph does not
    specialise on it."""
    # Values past the checkpoints are zeros, not left unwritten: they are an output of the custom op,
    # whose every value must be the same from one call to the next (AOTAutograd's checks compare them).
    dtype = torch.float32 if h0 is not None else h.dtype
    if segments is None:
        return h.new_zeros(size, dtype=dtype)
    states = save(h, h0, segments).reshape(-1)
    if size == states.numel():
        return states
    assert states.numel() <= size, f"{states.numel()} checkpoint values exceed their bound {size} (packed_count)"
    out = states.new_zeros(size)
    out[:states.numel()] = states
    return out


@lru_cache(maxsize=64)
def _segments(bounds: tuple[int, ...], L: int, device: torch.device) -> Segments:
    # Cached: a model's layers (and every step of a fixed-shape run) ask for the same
    # segments, and building them costs host-to-device copies.
    cu, table, starts, firsts, sequences = [0], [], [], [], []
    chunk = 0
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        nt = triton.cdiv(eos - bos, CHUNK)
        if nt:
            firsts.append(len(starts))
            sequences.append(n)
        for j in range(0, nt, L):
            starts.append(chunk + j)
            table.extend((len(starts) - 1, i) for i in range(min(L, nt - j)))
            cu.append(min(bos + (j + L) * CHUNK, eos))
        chunk += nt
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return Segments(L, torch.tensor(cu, dtype=torch.int32, device=device),
                    torch.tensor(table, dtype=torch.int32, device=device).view(-1, 2),
                    as_long(starts), as_long(firsts), as_long(sequences))


def save(h: torch.Tensor, h0: torch.Tensor | None, segments: Segments) -> torch.Tensor:
    """The checkpoints [NS, HV, K, V]: h at each segment's first chunk, in h's dtype; float32
    with each sequence's first segment holding ``h0`` exactly when there is one."""
    states = h.flatten(0, 1).index_select(0, segments.starts)
    if h0 is not None:
        states = states.float().index_copy_(0, segments.sequence_starts, h0.index_select(0, segments.sequences))
    return states


def rebuild(states: torch.Tensor, segments: Segments, u: torch.Tensor, **inputs):
    """h [B, NT, HV, ...] and v_new [B, T, HV, V], as the sequential rebuild returns them.

    The segments run through ``state_launch.fwd_h``, as the sequential rebuild does.
    ``inputs``: its other arguments (k, w, and g or gk; options such as ``state_v_first``); the per-token
    ones [B, T, ...] are joined into one row, as the segments' ``cu_seqlens`` count them."""
    B, T = u.shape[:2]

    def joined(x):
        return x.reshape(1, B * T, *x.shape[2:]) if isinstance(x, torch.Tensor) else x

    h, v_new, _ = state_launch.fwd_h(u=joined(u), **{n: joined(x) for n, x in inputs.items()},
                                     initial_state=states, output_final_state=False, chunk_size=CHUNK,
                                     cu_seqlens=segments.cu_seqlens, chunk_indices=segments.chunk_indices)
    return h.view(B, -1, *h.shape[2:]), v_new.view(u.shape)
