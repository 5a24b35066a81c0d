"""Triton kernel: the recompute backward's rebuild of h for GDN / DeltaNet, forming u itself.

Under ``recompute`` the backward rebuilds the states h (and v_new) with
FLA's forward walk, which reads u = A diag(beta) V, a [T, V] tensor that an
earlier pass (the fused prestage, or FLA's w/u recompute) wrote just for it.
With REWY_HF_GDN_FWD_WALK=1 (opt-in, not yet timed on the GPU) the prestage
skips u (and so reads no V), and this walk forms u for its value block from
A, beta and V on the way: u depends on neither h nor the previous chunk, so
the product sits beside the sequential chain. Per chunk, state in 64-row
halves over K as in FLA's walk:

    h_t stored (the state entering chunk t)
    u_t     = A_t diag(beta_t) V_t, rounded to the inputs' dtype as the stored u was
    v_new_t = u_t - W_t h_t                                  -> v_new
    h_t+1   = 2^(G_C) h_t + K_t^T (diag(2^(G_C - G)) v_new_t)

Sequences are rows or packed (``cu_seqlens``), each from its initial state:
the state checkpoints (state_checkpoints.py) run it on segments that way.
Layouts are FLA's: k [B, T, H, K]; w [B, T, HV, K]; v, v_new [B, T, HV, V];
beta [B, T, HV]; A [B, T, HV, 64]; h [B, NT, HV, K, V]. K up to 128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import direct_launch
from .env_switch import flag
from .state_launch import narrow_block_v
from .state_walk import (WALK_CONFIGS, load_halves, prune_widths, state_tiles, store_halves, walk_layout,
                         walk_program)

FWD_WALK_ENV = "REWY_HF_GDN_FWD_WALK"


def enabled() -> bool:
    """Whether REWY_HF_GDN_FWD_WALK asks for this rebuild (the prestage then skips u)."""
    return flag(FWD_WALK_ENV, False, on="rewy's rebuild of h that forms u itself",
                off="FLA's forward walk over the prestage's u")


@triton.autotune(configs=WALK_CONFIGS, key=["H", "HV", "K", "V", "BT", "USE_G", "NARROW"],
                 prune_configs_by={"early_config_prune": prune_widths})
@triton.jit(do_not_specialize=["T"])
def rewy_gdn_fwd_walk_kernel(
    k, w, v, beta, A, g, h0, h, v_new,
    cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, NARROW: tl.constexpr,
):
    i_v, i_nh, i_hv, i_h, bos, T, boh = walk_program(cu_seqlens, chunk_offsets, T, H, HV, V, BT, BV, IS_VARLEN)
    NT = tl.cdiv(T, BT)

    k += (bos * H + i_h) * K
    w += (bos * HV + i_hv) * K
    v += (bos * HV + i_hv) * V
    v_new += (bos * HV + i_hv) * V
    beta += bos * HV + i_hv
    A += (bos * HV + i_hv) * BT
    h += (boh * HV + i_hv) * K * V
    if USE_G:
        g += bos * HV + i_hv

    o_r = tl.arange(0, BT)
    o_k, m_k1, m_k2, o_v, m_v, off_s, m_s1, m_s2 = state_tiles(i_v, K, V, BV)
    if USE_H0:
        b_h1, b_h2 = load_halves(h0 + i_nh.to(tl.int64) * K * V, off_s, m_s1, m_s2, K, V)
    else:
        b_h1 = tl.zeros([64, BV], dtype=tl.float32)
        b_h2 = tl.zeros([64, BV], dtype=tl.float32)

    zero = bos * 0                      # int64, so chunk and token offsets are 64-bit however long the input
    for i_t in range(0, NT):
        c0 = zero + i_t * BT            # the chunk's first token
        store_halves(h + (zero + i_t) * (HV * K * V), b_h1, b_h2, off_s, m_s1, m_s2, K, V)
        m_t = c0 + o_r < T
        m_tv = m_t[:, None] & m_v[None, :]
        off_tv = (c0 + o_r)[:, None] * (HV * V) + o_v[None, :]

        # Off the chain: u = A diag(beta) V for this value block, rounded as the stored u was.
        b_A = tl.load(A + (c0 + o_r)[:, None] * (HV * BT) + o_r[None, :], mask=m_t[:, None], other=0.0)
        b_beta = tl.load(beta + (c0 + o_r) * HV, mask=m_t, other=0.0).to(tl.float32)
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0)
        b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(b_v.dtype)
        b_u = tl.dot(b_A.to(b_v.dtype), b_vb).to(v_new.dtype.element_ty).to(tl.float32)

        # The chain: v_new = u - W h, then the state one chunk on.
        off_tk = (c0 + o_r)[:, None] * (HV * K) + o_k[None, :]
        b_w = tl.load(w + off_tk, mask=m_t[:, None] & m_k1[None, :], other=0.0)
        b_wh = tl.dot(b_w, b_h1.to(b_w.dtype))
        if K > 64:
            b_w = tl.load(w + off_tk + 64, mask=m_t[:, None] & m_k2[None, :], other=0.0)
            b_wh = tl.dot(b_w, b_h2.to(b_w.dtype), b_wh)
        b_vn = b_u - b_wh
        tl.store(v_new + off_tv, b_vn.to(v_new.dtype.element_ty), mask=m_tv)
        if USE_G:
            last = tl.minimum(c0 + BT, T) - 1
            b_g = tl.load(g + (c0 + o_r) * HV, mask=m_t, other=0.0).to(tl.float32)
            b_glast = tl.load(g + last * HV).to(tl.float32)
            b_vn = b_vn * tl.where(m_t, tl.exp2(b_glast - b_g), 0.0)[:, None]
            b_h1 *= tl.exp2(b_glast)
            b_h2 *= tl.exp2(b_glast)
        b_vn = b_vn.to(k.dtype.element_ty)
        off_kt = o_k[:, None] + (c0 + o_r)[None, :] * (H * K)
        b_kT = tl.load(k + off_kt, mask=m_k1[:, None] & m_t[None, :], other=0.0)
        b_h1 = tl.dot(b_kT, b_vn, b_h1)
        if K > 64:
            b_kT = tl.load(k + off_kt + 64, mask=m_k2[:, None] & m_t[None, :], other=0.0)
            b_h2 = tl.dot(b_kT, b_vn, b_h2)


def rebuild_states(k, w, v, beta, A, g=None, initial_state=None, cu_seqlens=None, chunk_indices=None,
                   chunk_size: int = 64):
    """h and v_new as FLA's ``chunk_gated_delta_rule_fwd_h`` returns them for u = A diag(beta) V
    (K-first state, no final state), with u formed inside instead of read."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    N, NT, offsets = walk_layout(FWD_WALK_ENV, "FLA's forward walk", B, T, K, cu_seqlens, chunk_indices, chunk_size)
    h = k.new_empty(B, NT, HV, K, V)
    v_new = torch.empty_like(v)
    varlen = cu_seqlens is not None
    # Absent optional tensors are passed as v: the kernel never reads them then.
    direct_launch.launch(
        rewy_gdn_fwd_walk_kernel, lambda meta: (triton.cdiv(V, meta["BV"]) * N * HV,),
        k=k, w=w, v=v, beta=beta, A=A, g=g if g is not None else v,
        h0=initial_state if initial_state is not None else v, h=h, v_new=v_new,
        cu_seqlens=cu_seqlens if varlen else v, chunk_offsets=offsets if varlen else v, T=T, H=H, HV=HV, K=K, V=V,
        BT=chunk_size, USE_G=g is not None, USE_H0=initial_state is not None, IS_VARLEN=varlen,
        NARROW=narrow_block_v(N, HV, V) is not None,
    )
    return h, v_new
