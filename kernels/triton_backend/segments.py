"""Sequences cut into segments of L chunks, for the recurrences that run on segments at once.

Both the ``recompute`` rebuild of the forward states (state_checkpoints.py) and the split reverse
pass (split_reverse.py) run FLA-style sequential kernels on the segments as if they were packed
sequences. Segments start on chunk bounds of their sequence, so the segmented run numbers its
chunks as the whole-sequence run does, and its per-chunk outputs land where the whole-sequence
run would write them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from ..constants import CHUNK


@dataclass(frozen=True)
class Segments:
    """Every sequence cut into segments of ``length`` chunks (its last one shorter).

    cu_seqlens: [NS + 1] token bounds of the segments in the rows-joined layout
    (row b's tokens at b T .. b T + T - 1); chunk_indices: FLA's (segment, chunk)
    table for them; starts: [NS] the joined chunk index of each segment's first
    chunk; sequence_starts: the segment that begins each sequence with tokens, and
    sequences: which sequence that is (an empty packed sequence has no segment);
    per_sequence: on the host, how many segments each of those sequences has."""

    length: int
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    starts: torch.Tensor
    sequence_starts: torch.Tensor
    sequences: torch.Tensor
    per_sequence: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.starts)

    @property
    def cuts(self) -> bool:
        """Whether some sequence has more than one segment (else a segmented run is the sequential one)."""
        return self.count > len(self.sequence_starts)


@lru_cache(maxsize=64)
def cut(bounds: tuple[int, ...], L: int, device: torch.device) -> Segments:
    """The segments of L chunks of the sequences with token ``bounds`` (rows joined, or packed)."""
    # Cached: a model's layers (and every step of a fixed-shape run) ask for the same
    # segments, and building them costs host-to-device copies.
    cu, table, starts, firsts, sequences, per_sequence = [0], [], [], [], [], []
    chunk = 0
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        nt = triton.cdiv(eos - bos, CHUNK)
        if nt:
            firsts.append(len(starts))
            sequences.append(n)
            per_sequence.append(triton.cdiv(nt, L))
        for j in range(0, nt, L):
            starts.append(chunk + j)
            table.extend((len(starts) - 1, i) for i in range(min(L, nt - j)))
            cu.append(min(bos + (j + L) * CHUNK, eos))
        chunk += nt
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return Segments(L, torch.tensor(cu, dtype=torch.int32, device=device),
                    torch.tensor(table, dtype=torch.int32, device=device).view(-1, 2),
                    as_long(starts), as_long(firsts), as_long(sequences), tuple(per_sequence))


def row_bounds(B: int, T: int) -> tuple[int, ...]:
    """The token bounds of B rows of T tokens, joined into one row."""
    return tuple(range(0, B * T + 1, T))
