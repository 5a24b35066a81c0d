"""Triton kernel: the two per-chunk stages that precede GDN / DeltaNet's state recurrences.

Under the ``recompute`` policy, rewy's GDN / DeltaNet backward first rebuilds
the WY pair (w = A diag(beta) e^G K, u = A diag(beta) V) for the forward state
recurrence, and computes the local value gradient dV_loc = Aqk^T dO for the
reverse one. FLA runs them as two kernels (``recompute_w_u_fwd`` and
``chunk_bwd_dv_local``), each one program per (chunk, value head) and each
bound by memory: both read the chunk's keys. This kernel does both in one
program per (chunk, value head), so the keys are read once and one launch
(and its host time) goes.

Per program, with BK and BV covering K and V in as few tiles as the register
budget allows:
- over key tiles: the inclusive q-k Gram S^T = K Q^T (for dV_loc) accumulates,
  and w's tile is A (beta e^G K) and is stored at once;
- S^T is scaled, gated (exp2(G_i - G_j), log2 units as FLA keeps gates) and
  made causal (i >= j) once;
- over value tiles: u = A (beta V) and dV_loc = S^T dO.

Operand dtypes follow the stages it replaces: products take the inputs'
16-bit dtype in training, accumulate in fp32, and store in the input dtype.
One launch instead of two and the keys read once: on the H200 the kernel
takes less time than FLA's two (CHANGELOG.md has the figures).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunks import chunk_launches, chunk_table
from ..launch import launch
from ..tiles import bounds_mask

_CONFIGS = [triton.Config({}, num_warps=nw, num_stages=ns) for nw in (4, 8) for ns in (2, 3)]
# Key or value tiles narrower than 64: triton 3.6 builds the 4-warp configs so that they fault with an
# illegal memory access on the H200 (K = V = 16: at 4 warps with 2 or 3 stages, on two shapes out of
# three; K = V = 32 at 4 warps and 2 stages), where the 8-warp ones ran correctly at K = V = 16. An
# autotuner that benchmarked a faulting config would end the process, so narrow tiles never see them.
_NARROW_CONFIGS = [c for c in _CONFIGS if c.num_warps == 8]
_KEY = ["H", "HV", "K", "V", "BT", "BK", "BV", "USE_G", "IS_VARLEN"]


@triton.jit(do_not_specialize=["T"])
def rewy_gdn_prestage_kernel(
    q, k, v, g, beta, A, do, w, u, dv,
    cu_seqlens, chunk_indices, chunk_order,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    FULL_T: tl.constexpr,
):
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_c = tl.load(chunk_order + i_c).to(tl.int32)      # this launch's program -> its chunk in FLA's table
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        T_seq = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        i_t = i_c
        bos = i_b * T
        T_seq = T
    o_i = tl.arange(0, BT)
    valid = bounds_mask(i_t * BT + o_i, T_seq, FULL_T)
    # 64-bit scalar bases at the chunk's first token, 32-bit offsets inside it (as the local kernel).
    tok0 = (bos + i_t * BT).to(tl.int64)
    row_hv = tok0 * HV + i_hv
    beta += row_hv
    g += row_hv
    A += row_hv * BT
    v += row_hv * V
    do += row_hv * V
    u += row_hv * V
    dv += row_hv * V
    w += row_hv * K
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K

    b_beta = tl.load(beta + o_i * HV, mask=valid, other=0.0).to(tl.float32)
    if USE_G:
        b_g = tl.load(g + o_i * HV, mask=valid, other=0.0).to(tl.float32)
        b_kscale = b_beta * tl.exp2(b_g)
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
        b_kscale = b_beta
    b_A = tl.load(A + (o_i * HV)[:, None] * BT + o_i[None, :], mask=valid[:, None], other=0.0)

    # Key tiles: S^T = K Q^T accumulates; w = A (beta e^G K) is finished per tile.
    b_st = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = valid[:, None] & bounds_mask(o_k, K, K % BK == 0)[None, :]
        b_k = tl.load(k + (o_i * H)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_q = tl.load(q + (o_i * H)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_st += tl.dot(b_k, tl.trans(b_q))
        b_kb = (b_k.to(tl.float32) * b_kscale[:, None]).to(b_k.dtype)
        b_w = tl.dot(b_A.to(b_k.dtype), b_kb)
        tl.store(w + (o_i * HV)[:, None] * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_tk)

    # S^T[j, i] = scale q_i . k_j exp2(G_i - G_j) for i >= j: the exponent is masked before exp2,
    # so no entry above the diagonal (where it can be large and positive) can overflow.
    causal = (o_i[:, None] <= o_i[None, :]) & (valid[:, None] & valid[None, :])
    gam = tl.exp2(tl.where(causal, b_g[None, :] - b_g[:, None], float("-inf")))
    b_st = (b_st * gam * scale).to(do.dtype.element_ty)

    # Value tiles: u = A (beta V), dV_loc = S^T dO.
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = valid[:, None] & bounds_mask(o_v, V, V % BV == 0)[None, :]
        off_tv = (o_i * HV)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0)
        b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(b_v.dtype)
        b_u = tl.dot(b_A.to(b_v.dtype), b_vb)
        tl.store(u + off_tv, b_u.to(u.dtype.element_ty), mask=m_tv)
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        b_dv = tl.dot(b_st, b_do)
        tl.store(dv + off_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)


# Two autotuners over the one jit function (whose name the bench's autotune picks record).
_prestage_jit = rewy_gdn_prestage_kernel
rewy_gdn_prestage_kernel = triton.autotune(configs=_CONFIGS, key=_KEY)(_prestage_jit)
rewy_gdn_prestage_kernel_narrow = triton.autotune(configs=_NARROW_CONFIGS, key=_KEY)(_prestage_jit)


def prestage_kernel(BK: int, BV: int):
    """The autotuned kernel for these tile widths: below 64 only the configs that run there."""
    return rewy_gdn_prestage_kernel if min(BK, BV) >= 64 else rewy_gdn_prestage_kernel_narrow


def recompute_wu_and_dv_local(q, k, v, beta, A, do, g=None, scale: float = 1.0, cu_seqlens=None,
                              chunk_indices=None, block: int = 64):
    """w, u (the WY pair) and dV_loc = Aqk^T dO of every chunk, in FLA's layout.

    q, k: [B, T, H, K]; v, do: [B, T, HV, V]; beta: [B, T, HV]; g: the log2-unit
    chunk cumsum [B, T, HV] (None for DeltaNet); A: [B, T, HV, 64]. Returns
    w [B, T, HV, K] in k's dtype, u [B, T, HV, V] in v's and dV_loc in do's.
    ``block``: the key and value tile width (64 or 128).
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = A.shape[-1]
    if block not in (64, 128):
        raise ValueError(f"block={block}: use 64 or 128 (the tile width over K and V)")
    varlen = cu_seqlens is not None
    if varlen and B != 1:
        raise ValueError("packed sequences (cu_seqlens) need B = 1, as in FLA")
    _, chunk_indices = chunk_table(T, cu_seqlens, BT, chunk_indices)
    w = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    dv = torch.empty_like(do)
    BK, BV = min(block, max(16, triton.next_power_of_2(K))), min(block, max(16, triton.next_power_of_2(V)))
    # An absent gate or packing table is passed as beta: the kernel never reads it then.
    for chunks, order, full in chunk_launches(T, cu_seqlens, BT):
        launch(
            prestage_kernel(BK, BV), (chunks, B * HV), q=q, k=k, v=v, g=g if g is not None else beta, beta=beta,
            A=A, do=do, w=w, u=u, dv=dv, cu_seqlens=cu_seqlens if varlen else beta,
            chunk_indices=chunk_indices if varlen else beta, chunk_order=order if varlen else beta, scale=scale,
            T=T, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_G=g is not None, IS_VARLEN=varlen, FULL_T=full,
        )
    return w, u, dv
