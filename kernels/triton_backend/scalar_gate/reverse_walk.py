"""Triton kernel: GDN / DeltaNet's reverse state recurrence (the state gradients and dv2).

The backward runs this walk in place of FLA's ``bwd_dhu`` for key head dims up
to 128 (``takes``), under both policies. It takes the same inputs (the local
value gradient dV_loc from the prestage or FLA's local dv stage) and returns
the same outputs. The difference is one product: FLA forms the gated queries
q e^G in fp32 and multiplies them with dO as fp32 operands, a tf32 product
that takes twice the tensor-core instructions of a 16-bit one (compiled for
sm_90 at BV 32, this walk has 32 of them that way against 24). Here the gated
queries are rounded to the inputs' 16-bit dtype first, as FLA's KDA walk does
with its gated queries. G is the chunk-local cumulative log-gate (<= 0), so
e^G <= 1 and the rounding is relative, the same size as that of the bf16
state gradient the walk stores.
On the H200 the gated walk takes 0.87 ms where FLA's takes 1.07 ms at
(1, 32768, 32), with its dh error against an fp64 recurrence 2.35e-3 against
FLA's 2.24e-3 (docs/studies.md).

Per program (sequence, value head, block of BV value columns), chunks from
last to first, the state gradient held as two 64-row halves over K in fp32
(as FLA's walk holds it: one [K, BV] tile spills and runs slower):

    dh_t stored (the gradient of the state leaving chunk t)
    dV_t   = dV_loc_t + diag(2^(G_C - G)) K_t dh_t           -> dv2
    dh_t-1 = 2^(G_C) dh_t + scale (Q_t diag(2^G))^T dO_t - W_t^T dV_t

G in log2 units as FLA keeps it (none for DeltaNet), G_C its value at the
chunk's last row. dh0 = the gradient after the first chunk. Layouts are FLA's:
q, k [B, T, H, K]; w [B, T, HV, K]; do, dv, dv2 [B, T, HV, V];
dh [B, NT, HV, K, V]. K up to 128 (two halves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunks import chunk_count_and_offsets
from ..launch import launch
from ..state_launch import narrow_block_v

MAX_K = 128


def takes(k: torch.Tensor) -> bool:
    """Whether the walk can serve this backward's reverse pass (k [B, T, H, K]): K up to MAX_K.
    Wider keys keep FLA's bwd_dhu."""
    return k.shape[-1] <= MAX_K


def prune_widths(configs, named_args, **kwargs):
    """BV 16 only where FLA's widths would leave most SMs idle (the state launch's rule, passed as
    NARROW), 32 and 64 elsewhere."""
    narrow = (named_args if "NARROW" in named_args else kwargs)["NARROW"]
    kept = [c for c in configs if (c.kwargs["BV"] == 16) == bool(narrow)]
    return kept or configs[:1]


# Compiled offline for sm_90, BV 64 at 2 warps spills 1.5-14 KB, so BV 64 runs at 4 and 8 warps; at the
# configs FLA's walk also lists, this walk compiles to about FLA's registers and instructions per product.
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


@triton.autotune(configs=WALK_CONFIGS, key=["H", "HV", "K", "V", "BT", "USE_G", "NARROW"],
                 prune_configs_by={"early_config_prune": prune_widths})
@triton.jit(do_not_specialize=["T"])
def rewy_gdn_walk_kernel(
    q, k, w, g, dv, do, dht, dh0, dh, dv2,
    cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_DHT: tl.constexpr, USE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    NARROW: tl.constexpr,
):
    i_v, i_nh, i_hv, i_h, bos, T, boh = walk_program(cu_seqlens, chunk_offsets, T, H, HV, V, BT, BV, IS_VARLEN)
    NT = tl.cdiv(T, BT)

    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    w += (bos * HV + i_hv) * K
    dv += (bos * HV + i_hv) * V
    do += (bos * HV + i_hv) * V
    dv2 += (bos * HV + i_hv) * V
    dh += (boh * HV + i_hv) * K * V
    if USE_G:
        g += bos * HV + i_hv

    o_r = tl.arange(0, BT)
    o_k, m_k1, m_k2, o_v, m_v, off_s, m_s1, m_s2 = state_tiles(i_v, K, V, BV)
    if USE_DHT:
        b_dh1, b_dh2 = load_halves(dht + i_nh.to(tl.int64) * K * V, off_s, m_s1, m_s2, K, V)
    else:
        b_dh1 = tl.zeros([64, BV], dtype=tl.float32)
        b_dh2 = tl.zeros([64, BV], dtype=tl.float32)

    zero = bos * 0                      # int64, so chunk and token offsets are 64-bit however long the input
    for i_t in range(NT - 1, -1, -1):
        c0 = zero + i_t * BT            # the chunk's first token
        store_halves(dh + (zero + i_t) * (HV * K * V), b_dh1, b_dh2, off_s, m_s1, m_s2, K, V)
        m_t = c0 + o_r < T
        m_tv = m_t[:, None] & m_v[None, :]
        off_tv = (c0 + o_r)[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)

        b_dv = tl.load(dv + off_tv, mask=m_tv, other=0.0).to(tl.float32)     # the local term, off the chain

        # The chain: K dh (gated to the chunk's end), then the state gradient one chunk back.
        off_tk = (c0 + o_r)[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + off_tk, mask=m_t[:, None] & m_k1[None, :], other=0.0)
        b_kdh = tl.dot(b_k, b_dh1.to(b_k.dtype))
        if K > 64:
            b_k = tl.load(k + off_tk + 64, mask=m_t[:, None] & m_k2[None, :], other=0.0)
            b_kdh = tl.dot(b_k, b_dh2.to(b_k.dtype), b_kdh)
        if USE_G:
            last = tl.minimum(c0 + BT, T) - 1
            b_g = tl.load(g + (c0 + o_r) * HV, mask=m_t, other=0.0).to(tl.float32)
            b_glast = tl.load(g + last * HV).to(tl.float32)
            b_kdh *= tl.where(m_t, tl.exp2(b_glast - b_g), 0.0)[:, None]
        b_dv += b_kdh
        tl.store(dv2 + off_tv, b_dv.to(dv2.dtype.element_ty), mask=m_tv)
        b_dv_lp = b_dv.to(w.dtype.element_ty)

        # Q^T and W^T per half: [64 key rows, BT tokens].
        off_kt = o_k[:, None] + (c0 + o_r)[None, :] * (H * K)
        off_wkt = o_k[:, None] + (c0 + o_r)[None, :] * (HV * K)
        b_qT = tl.load(q + off_kt, mask=m_k1[:, None] & m_t[None, :], other=0.0)
        b_wT = tl.load(w + off_wkt, mask=m_k1[:, None] & m_t[None, :], other=0.0)
        if USE_G:
            b_eg = tl.exp2(b_g)
            b_eglast = tl.exp2(b_glast)
            # the gated queries in the inputs' dtype (module docstring): a 16-bit product, as dO's
            b_dh1 = b_dh1 * b_eglast + tl.dot((b_qT * b_eg[None, :]).to(b_qT.dtype), b_do) * scale
        else:
            b_dh1 += tl.dot(b_qT, b_do) * scale
        b_dh1 -= tl.dot(b_wT, b_dv_lp)
        if K > 64:
            b_qT = tl.load(q + off_kt + 64, mask=m_k2[:, None] & m_t[None, :], other=0.0)
            b_wT = tl.load(w + off_wkt + 64, mask=m_k2[:, None] & m_t[None, :], other=0.0)
            if USE_G:
                b_dh2 = b_dh2 * b_eglast + tl.dot((b_qT * b_eg[None, :]).to(b_qT.dtype), b_do) * scale
            else:
                b_dh2 += tl.dot(b_qT, b_do) * scale
            b_dh2 -= tl.dot(b_wT, b_dv_lp)

    if USE_DH0:
        store_halves(dh0 + i_nh.to(tl.int64) * K * V, b_dh1, b_dh2, off_s, m_s1, m_s2, K, V)


def reverse_walk(q, k, w, do, dv, g=None, h0=None, dht=None, scale: float = 1.0, cu_seqlens=None,
                 chunk_indices=None, chunk_size: int = 64):
    """dh, dh0, dv2 as FLA's ``chunk_gated_delta_rule_bwd_dhu`` returns them (K-first state), from the
    same inputs (``dv``: the local value gradient, [B, T, HV, V])."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if K > MAX_K:
        raise ValueError(f"the reverse walk takes key head dims up to {MAX_K} (got {K}); FLA's bwd_dhu takes wider")
    if cu_seqlens is not None and B != 1:
        raise ValueError("packed sequences (cu_seqlens) need B = 1, as in FLA")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    NT, offsets = chunk_count_and_offsets(T, cu_seqlens, chunk_size, chunk_indices)
    dh = q.new_empty(B, NT, HV, K, V)
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(dv)
    varlen = cu_seqlens is not None
    # Absent optional tensors are passed as do: the kernel never reads them then.
    launch(
        rewy_gdn_walk_kernel, lambda meta: (triton.cdiv(V, meta["BV"]) * N * HV,),
        q=q, k=k, w=w, g=g if g is not None else do, dv=dv, do=do, dht=dht if dht is not None else do,
        dh0=dh0 if dh0 is not None else do, dh=dh, dv2=dv2, cu_seqlens=cu_seqlens if varlen else do,
        chunk_offsets=offsets if varlen else do, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size,
        USE_G=g is not None, USE_DHT=dht is not None, USE_DH0=dh0 is not None, IS_VARLEN=varlen,
        NARROW=narrow_block_v(N, HV, V) is not None,
    )
    return dh, dh0, dv2
