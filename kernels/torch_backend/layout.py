"""Between FLA's token layout and the torch backend's chunk layout.

FLA ops take ``[B, T, H, D]`` (with ``cu_seqlens``: B = 1 and T the packed
length of N sequences). The chunked core wants the chunk-major layout
``[NT, N, H, C, D]``: every sequence starts a fresh chunk of C tokens, and the
chunk index leads so that each step of the sequential state recurrence reads
one contiguous ``[N, H, C, D]`` slab.

Padding tokens are zeros: a zero key and zero erase gate leave the state
untouched and a zero log-gate decays nothing, so the state after the padded
tail equals the true final state. Outputs at padded positions are dropped.
These are plain indexing ops, so autograd carries gradients through them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ChunkLayout:
    """Maps ``[B, T, H, D]`` tensors to ``[NT, N, H, C, D]`` and back."""

    def __init__(self, B: int, T: int, chunk: int, cu_seqlens: torch.Tensor | None, device: torch.device):
        self.T = T
        self.chunk = chunk
        if cu_seqlens is None:
            self.num_seqs = B
            self.padded_len = -(-T // chunk) * chunk
            self.gather = None
            return
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        self.num_seqs = len(lens)
        # [NT, N]: which (chunk, sequence) slots hold tokens (see pack_slots)
        self.filled = (torch.arange(max(1, -(-max(lens, default=0) // chunk)), device=device)[:, None]
                       < torch.tensor([-(-n // chunk) for n in lens], device=device)[None, :])
        self.padded_len = max(1, -(-max(lens, default=0) // chunk)) * chunk
        pos = torch.arange(self.padded_len, device=device)
        starts = cu_seqlens[:-1].to(device=device, dtype=torch.long).unsqueeze(1)
        valid = pos.unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
        # Index T points at an appended zero row, so padding reads zeros.
        self.gather = torch.where(valid, starts + pos, torch.full_like(starts + pos, T))
        self.scatter = valid.flatten().nonzero().squeeze(1)     # token order, since cu_seqlens ascends

    def pack_slots(self, x: torch.Tensor) -> torch.Tensor:
        """A per-chunk tensor [NT, N, ...] of packed sequences as [packed_chunks(T, N), 1, ...]: the
        slots that hold tokens in order, then zeros. NT follows the longest sequence, a value; the
        bound follows the shapes alone, so the backward's saved tensors can be described without
        reading the lengths (a compiled graph keeps them as fixed-size tensors)."""
        if self.gather is None:
            return x
        bound = packed_chunks(self.T, self.num_seqs, self.chunk)
        kept = x[self.filled]
        return torch.cat([kept, kept.new_zeros(bound - kept.shape[0], *kept.shape[1:])]).unsqueeze(1)

    def unpack_slots(self, y: torch.Tensor) -> torch.Tensor:
        """``pack_slots`` undone: [NT, N, ...] with zeros in the slots past each sequence's end."""
        if self.gather is None:
            return y
        out = y.new_zeros(*self.filled.shape, *y.shape[2:])
        out[self.filled] = y[: int(self.filled.sum()), 0]
        return out

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is None:
            x = F.pad(x, (0, 0, 0, 0, 0, self.padded_len - self.T))
        else:
            x = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])[self.gather]
        # [N, Tp, H, D] -> [N, NT, C, H, D] -> [NT, N, H, C, D]
        return x.unflatten(1, (-1, self.chunk)).permute(1, 0, 3, 2, 4).contiguous()

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        y = y.permute(1, 0, 3, 2, 4).flatten(1, 2)       # [N, Tp, H, D]
        if self.gather is None:
            return y[:, : self.T]
        return y.flatten(0, 1)[self.scatter].unsqueeze(0)


def packed_chunks(T: int, sequences: int, chunk: int) -> int:
    """The most chunks ``sequences`` packed sequences of T tokens in all can have: each begins a
    chunk, so at most one partial chunk per sequence beyond T / chunk."""
    return -(-T // chunk) + max(sequences, 1) - 1
