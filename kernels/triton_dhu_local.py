"""The reverse state recurrence with the local value gradient folded in (rewy's kernel).

FLA 0.6.0's backward runs two kernels before the local ReWY stage:

1. the local value gradient, dV_loc = A^T dO per chunk, where A is the
   causal, gated intra-chunk attention: recomputed from q, k and the gate for
   GDN and DeltaNet (``chunk_bwd_dv_local``), read from the saved A_qk for KDA
   and GDN2 (``chunk_kda_bwd_dAv``, which also writes dA_qk);
2. the reverse state recurrence (``chunk_gated_delta_rule_bwd_dhu``), which
   walks the chunks from last to first:

       dh_t stored,  dV_t = K~_t dh_t + dV_loc_t,
       dh_{t-1} = decay_t * dh_t + scale * Q~_t^T dO_t - W_t^T dV_t

   (K~ and Q~ the gated keys and queries, decay the chunk's total gate).

Each program of the recurrence already loads the chunk's q, k and dO, and
holds a column block of the state; dV_loc_t for that block depends on neither
dh nor the previous step. So this kernel computes it inside the walk: the
sequential dependency (dh through K~ dh and W^T dV) is unchanged, the local
product sits beside it, and dV_loc never goes through memory. It saves one
launch, one write and one read of a [T, V] tensor per head, and (for GDN)
FLA's recomputation of A in a separate pass.

Layouts are FLA's: q, k [B, T, H, K]; w [B, T, HV, K]; do [B, T, HV, V];
g [B, T, HV] (GDN, log2 units, chunk-local cumulative sums) or gk
[B, T, HV, K] (KDA / GDN2); A [B, T, HV, BT] (KDA / GDN2: A_qk, scale folded
in, as FLA's forward saves it); dh [B, NT, HV, K, V] ([.., V, K] with
``state_v_first``). K up to 128: the whole key side of the state is one tile.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .state_launch import chunks_of, narrow_block_v

MAX_K = 128
LOCAL_DV_ENV = "REWY_HF_LOCAL_DV"


def _prune_widths(configs, nargs, **kw):
    """BV 16 only where FLA's widths leave the SMs idle (state_launch.narrow_block_v), 32 and 64
    elsewhere; all configs if that leaves none (an autotuner cut to one config, as on CPU)."""
    narrow = (nargs if "NARROW" in nargs else kw)["NARROW"]
    kept = [c for c in configs if (c.kwargs["BV"] == 16) == bool(narrow)]
    return kept or configs


@triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
             for bv in (32, 64, 16) for nw, ns in ((4, 2), (4, 3), (2, 2), (8, 2))],
    key=["H", "HV", "K", "V", "BT", "USE_G", "USE_GK", "LOCAL_A", "STATE_V_FIRST", "NARROW", "PROGRAMS"],
    prune_configs_by={"early_config_prune": _prune_widths},
)
@triton.jit(do_not_specialize=["T", "PROGRAMS"])
def rewy_dhu_local_kernel(
    q, k, w, g, gk, A, dht, dh0, do, dh, dv2,
    cu_seqlens, chunk_offsets, scale, T, PROGRAMS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_GK: tl.constexpr, LOCAL_A: tl.constexpr, NARROW: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
):
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
    NT = tl.cdiv(T, BT)

    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    w += (bos * HV + i_hv) * K
    do += (bos * HV + i_hv) * V
    dv2 += (bos * HV + i_hv) * V
    dh += (boh * HV + i_hv) * K * V
    if USE_G:
        g += bos * HV + i_hv
    if USE_GK:
        gk += (bos * HV + i_hv) * K
    if LOCAL_A == "given":
        A += (bos * HV + i_hv) * BT

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # the state tile is [BK, BV] in registers either way; only its address pattern follows the layout
    if STATE_V_FIRST:
        off_s = o_v[None, :] * K + o_k[:, None]
    else:
        off_s = o_k[:, None] * V + o_v[None, :]
    o_r = tl.arange(0, BT)

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + off_s, mask=m_kv, other=0.0).to(tl.float32)

    zero = bos * 0              # int64: chunk and token offsets below are 64-bit however long the sequence
    for i_t in range(NT - 1, -1, -1):
        c0 = zero + i_t * BT    # the chunk's first token
        tl.store(dh + (zero + i_t) * (HV * K * V) + off_s, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        m_t = c0 + o_r < T
        last = tl.minimum(c0 + BT, T) - 1
        m_tk = m_t[:, None] & m_k[None, :]
        m_kt = m_k[:, None] & m_t[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        off_tv = o_r[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + c0 * (HV * V) + off_tv, mask=m_tv, other=0.0)
        b_k = tl.load(k + c0 * (H * K) + o_r[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_qT = tl.load(q + c0 * (H * K) + o_k[:, None] + o_r[None, :] * (H * K), mask=m_kt, other=0.0)
        if USE_G:
            b_g = tl.load(g + (c0 + o_r) * HV, mask=m_t, other=0.0).to(tl.float32)
            b_glast = tl.load(g + last * HV).to(tl.float32)

        # Local value gradient for this value block: dV_loc = A^T dO, A^T[j, i] nonzero for j <= i.
        m_AT = (o_r[:, None] <= o_r[None, :]) & m_t[:, None] & m_t[None, :]
        if LOCAL_A == "given":
            b_AT = tl.load(A + c0 * (HV * BT) + o_r[None, :] * (HV * BT) + o_r[:, None], mask=m_AT, other=0.0)
        else:
            b_AT = tl.dot(b_k, b_qT) * scale                     # k_j . q_i
            if USE_G:
                # gate ratio e^{g_i - g_j} <= 1 on the kept triangle; masked first so no exponent is positive
                b_AT *= tl.exp2(tl.where(m_AT, b_g[None, :] - b_g[:, None], 0.0))
        b_AT = tl.where(m_AT, b_AT, 0.0)
        b_dv = tl.dot(b_AT.to(b_do.dtype), b_do)

        # Inter-chunk part: K~ dh, with K~ = k e^{g_last - g} (GDN) or k as given (KDA passes k e^{G_C - G}).
        b_kdh = tl.dot(b_k, b_dh.to(b_k.dtype))
        if USE_G:
            b_kdh *= tl.exp2(tl.where(m_t, b_glast - b_g, 0.0))[:, None]
        b_dv += b_kdh
        b_dvn = b_dv.to(dv2.dtype.element_ty)
        tl.store(dv2 + c0 * (HV * V) + off_tv, b_dvn, mask=m_tv)

        # dh_{t-1} = decay dh_t + scale Q~^T dO - W^T dV, decay e^{g_last} (GDN) or e^{G_C} per key (KDA)
        b_wT = tl.load(w + c0 * (HV * K) + o_k[:, None] + o_r[None, :] * (HV * K), mask=m_kt, other=0.0)
        if USE_G:
            b_dh *= tl.exp2(b_glast)
            b_qg = b_qT.to(tl.float32) * tl.exp2(b_g)[None, :]
            b_dh += tl.dot(b_qg, b_do.to(tl.float32)) * scale
        else:
            if USE_GK:
                b_dh *= tl.exp2(tl.load(gk + last * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32))[:, None]
            b_dh += tl.dot(b_qT, b_do.to(b_qT.dtype)) * scale
        b_dh -= tl.dot(b_wT, b_dvn.to(b_wT.dtype))

    if USE_INITIAL_STATE:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_s, b_dh.to(dh0.dtype.element_ty), mask=m_kv)


def supported(K: int, sequence_segments: int) -> bool:
    """Whether this kernel covers a call: key head dims up to MAX_K, FLA's sequential walk (no split)."""
    return K <= MAX_K and sequence_segments == 1


def use_fused_local_dv(K: int, sequence_segments: int) -> bool:
    """REWY_HF_LOCAL_DV: ``fused`` (the default) runs this kernel where it applies (``supported``),
    FLA's local dv and bwd_dhu elsewhere (wider heads, the sequence split); ``fla`` always FLA's two."""
    mode = os.environ.get(LOCAL_DV_ENV, "fused").strip().lower()
    if mode not in ("", "fused", "fla"):
        raise ValueError(f"{LOCAL_DV_ENV}={mode!r} is not understood; use fused (the default: the local dv inside "
                         "rewy's reverse state recurrence) or fla (FLA's local dv and bwd_dhu kernels)")
    return mode != "fla" and supported(K, sequence_segments)


def rewy_dhu_local(q, k, w, do, g=None, gk=None, A=None, h0=None, dht=None, scale=1.0, state_v_first=False,
                   cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """dh, dh0, dv2 of the reverse state recurrence, the local value gradient computed inside.
    ``A`` (KDA / GDN2): FLA's saved A_qk; without it A is recomputed from q, k and ``g``."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[-1]
    if K > MAX_K:
        raise ValueError(f"rewy_dhu_local takes key head dims up to {MAX_K}, got {K}; call FLA's local dv and "
                         "bwd_dhu for wider heads (kernels.triton_dhu_local.supported says which)")
    if gk is not None and A is None:
        raise ValueError("per-key gates (KDA / GDN2) need the saved A_qk: pass A")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    NT, chunk_offsets = chunks_of(T, cu_seqlens, chunk_size, chunk_indices)
    dh = q.new_empty(B, NT, HV, *((V, K) if state_v_first else (K, V)))
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(do)
    narrow = narrow_block_v(N, HV, V) is not None
    grid = lambda meta: (triton.cdiv(V, meta["BV"]) * N * HV,)      # noqa: E731
    rewy_dhu_local_kernel[grid](
        q, k, w, g, gk, A, dht, dh0, do, dh, dv2, cu_seqlens, chunk_offsets, scale, T,
        triton.next_power_of_2(N * HV),
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=max(16, triton.next_power_of_2(K)),
        USE_G=g is not None, USE_GK=gk is not None, LOCAL_A="given" if A is not None else "qk", NARROW=narrow,
        USE_INITIAL_STATE=h0 is not None, USE_FINAL_STATE_GRADIENT=dht is not None,
        STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None)
    return dh, dh0, dv2
