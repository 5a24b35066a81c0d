"""How many key channels one program of rewy's kernels takes at a time.

A tile's side must be a power of two (Triton) and at least 16 (a tensor-core
product); past 64 channels the fp32 tiles of one program outgrow its
registers. So K is rounded up to a power of two and held between 16 and 64;
wider heads are covered by several blocks (or, in the sequence split, two
row halves of the state).
"""

from __future__ import annotations

import triton


def key_block(K: int) -> int:
    """Channels per key block for a key head dim of K: next power of two, clamped to [16, 64]."""
    return min(64, max(16, triton.next_power_of_2(K)))


def size_class(chunks: int) -> int:
    """Autotune key for a launch over ``chunks`` chunk tiles (batch x chunks x heads): the next power
    of two. Keying on T itself would re-tune every new sequence length, which with packed sequences of
    varying total length (``cu_seqlens``) or dynamic padding is every training step."""
    return triton.next_power_of_2(max(1, chunks))
