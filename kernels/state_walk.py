"""The layout of rewy's state walk (triton_gdn_walk.py): launch configs, the program's place and halves.

The walk runs one program per (sequence, value head, block of BV value
columns) and holds the state gradient as 64-row halves over K in fp32, as
FLA's walks do. Here: its launch configs, where a program sits and its
sequence's bounds, and loading and storing the two halves.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .state_launch import chunk_count_and_offsets

MAX_K = 128


def walk_layout(switch: str, what: str, B: int, T: int, K: int, cu_seqlens, chunk_indices, chunk_size: int):
    """(sequences, chunks per row, first chunk of each packed sequence or None) for a walk, after
    refusing what it cannot take; ``switch`` / ``what``: its environment switch and what 0 runs."""
    if K > MAX_K:
        raise ValueError(f"{switch}=1 supports key head dims up to {MAX_K} (got {K}); set {switch}=0 for {what}")
    if cu_seqlens is not None and B != 1:
        raise ValueError("packed sequences (cu_seqlens) need B = 1, as in FLA")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    return (N, *chunk_count_and_offsets(T, cu_seqlens, chunk_size, chunk_indices))


def prune_widths(configs, named_args, **kwargs):
    """BV 16 only where FLA's widths would leave most SMs idle (the state launch's rule, passed as
    NARROW), 32 and 64 elsewhere."""
    narrow = (named_args if "NARROW" in named_args else kwargs)["NARROW"]
    kept = [c for c in configs if (c.kwargs["BV"] == 16) == bool(narrow)]
    return kept or configs[:1]


# Offline (sm_90, benchmarks/kernel_registers.py) BV 64 at 2 warps spills 1.5-14 KB in the reverse walk,
# so BV 64 runs at 4 and 8 warps; at the configs FLA's walk also lists, the walk compiles to about
# FLA's registers and instructions per product.
WALK_CONFIGS = [triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
                for bv, warps in ((32, (2, 4)), (64, (4, 8)), (16, (2, 4))) for nw in warps for ns in (1, 2, 3)]


@triton.jit
def walk_program(cu_seqlens, chunk_offsets, T, H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(value block, sequence x value head, value head, key head, first token, length, first chunk)
    of this program; token and chunk offsets are int64."""
    NV = tl.cdiv(V, BV)
    pid = tl.program_id(0)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        boh = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return i_v, i_nh, i_hv, i_h, bos, T, boh


@triton.jit
def state_tiles(i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Key offsets of one half with its two masks, this block's value offsets and mask, and the
    offsets and masks of the two [64, BV] halves in a [K, V] state."""
    o_k = tl.arange(0, 64)
    m_k1 = o_k < K
    m_k2 = o_k + 64 < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    off_s = o_k[:, None] * V + o_v[None, :]
    return o_k, m_k1, m_k2, o_v, m_v, off_s, m_k1[:, None] & m_v[None, :], m_k2[:, None] & m_v[None, :]


@triton.jit
def load_halves(p, off_s, m_s1, m_s2, K: tl.constexpr, V: tl.constexpr):
    b1 = tl.load(p + off_s, mask=m_s1, other=0.0).to(tl.float32)
    b2 = tl.zeros_like(b1)
    if K > 64:
        b2 += tl.load(p + off_s + 64 * V, mask=m_s2, other=0.0).to(tl.float32)
    return b1, b2


@triton.jit
def store_halves(p, b1, b2, off_s, m_s1, m_s2, K: tl.constexpr, V: tl.constexpr):
    tl.store(p + off_s, b1.to(p.dtype.element_ty), mask=m_s1)
    if K > 64:
        tl.store(p + off_s + 64 * V, b2.to(p.dtype.element_ty), mask=m_s2)
