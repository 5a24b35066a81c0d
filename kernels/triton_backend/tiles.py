"""Tile widths and bounds masks shared by rewy's Triton kernels.

Key blocks: a tile's side must be a power of two (Triton) and at least 16 (a
tensor-core product); past 64 channels the fp32 tiles of one program outgrow
its registers. So K is rounded up to a power of two and held between 16 and
64; wider heads are covered by several blocks.

Bounds masks: every tile load is masked against the sequence end and the head
dimensions. Where a bound cannot bite (a block width divides K or V; every
chunk of a launch has all its rows) the mask is all true; as a compile-time
constant Triton folds it out of the loads and stores, which removes their
address checks and selects (about 11 % of Matrix Intra's instructions). With
packed sequences only a sequence's last chunk can be short, so the chunk
kernels serve the full chunks in one launch and the short ones in another
(``chunks.chunk_launches``).
"""

from __future__ import annotations

import triton
import triton.language as tl


def key_block(K: int) -> int:
    """Channels per key block for a key head dim of K: next power of two, clamped to [16, 64]."""
    return min(64, max(16, triton.next_power_of_2(K)))


def size_class(chunks: int) -> int:
    """Autotune key for a launch over ``chunks`` chunk tiles (batch x chunks x heads): the next power
    of two. Keying on T itself would re-tune every new sequence length, which with packed sequences of
    varying total length (``cu_seqlens``) or dynamic padding is every training step."""
    return triton.next_power_of_2(max(1, chunks))


@triton.jit
def bounds_mask(o, n, ALL: tl.constexpr):
    """o < n, or an all-true constant of o's shape when ALL says the bound cannot bite."""
    if ALL:
        return tl.full(o.shape, 1, tl.int1)
    else:
        return o < n
