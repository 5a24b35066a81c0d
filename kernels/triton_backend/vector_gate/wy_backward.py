"""Triton kernel: Residual WY and the inter-chunk terms of the KDA / GDN2 backward (stage 1 of 2).

Symbols (per chunk of BT = 64 tokens, docs/architecture.md): G the
chunk-local cumulative log-gates (FLA keeps them in log2 units, so e^G is
``exp2(g)``), a = b*k the erase-weighted keys, X = a e^G, Y = w*v, the
strictly lower gated key Gram L, A = (I + L)^{-1} (FLA's ``Akk``),
W = A X, U = A Y, Vn = U - W h.

Grid (chunks x (NK + 1), batch x value heads; a chunk's programs adjacent, so
the tiles several of them read come from L2 for all but the first).
Programs 0..NK-1 each own a block of BK key channels: over the value axis
they form dW = -dVn h^T, d(q e^G) = dO h^T, d(k e^{G_C-G}) = Vn dh^T and the
decay term sum_v h*dh, then Residual WY's dX = A^T dW, and write the
inter-chunk parts of dq, dk, the gate gradient (summed over the chunk:
stage 2 adds its own terms' sum) and the erase-gate gradient. Program NK owns the value side:

    dY = A^T dVn (giving dv and the write-gate gradient),   dL = -dY Vn^T.

That last line is Residual WY collapsed one step further: Residual WY gives
dL = -(dX W^T + dY U^T); with dW = -dVn h^T, dX = -dY h^T, so
dX W^T + dY U^T = dY (U - W h)^T = dY Vn^T. No contraction over K is needed
for dL, and W and U are never read. Three products in all: dY, dL and dX.

KDA's erase gate is a scalar per token, so its gradient is a sum over K:
each K block writes its partial into its own slot of a [.., NK + 1] buffer
(slot NK from the value side); nothing is reduced with atomics.

The kernel is latency-bound: fewer warps than its tile sizes suggest are
fastest. Configs whose compiled code gave wrong or run-to-run different
outputs under triton 3.6.0 (4 warps with software pipelining, or with a
``maxnreg`` cap) are kept out of the autotune list.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...constants import CHUNK
from ..chunks import chunk_launches, chunk_table
from ..tiles import bounds_mask, key_block, size_class
from . import common
from .common import exp2_where


def wy_config_ok(BK: int, config: triton.Config) -> bool:
    """Whether the Residual WY kernel may run with ``config`` and key blocks of BK channels. With one
    warpgroup (4 warps), value tiles of 64 and key blocks narrower than 64 (BK 16 or 32), triton 3.6.0
    miscompiles the key side on the H200: dk, the gate and the erase-gate partials come out wrong
    (20 % off at BK 32), or the launch faults with an illegal memory access (BK 16; BK 32 at
    (2, 8192, 16)). The kernel's indexing is not at fault: the interpreter gives the right outputs,
    compute-sanitizer finds no out-of-bounds access where the values are wrong, and the same code is
    right with 8 warps, or value tiles of 128 or 32, at BK 32, and with 4 warps at BK 64.
    The autotuner prunes such configs; ``rewy_kda_bwd_wy`` refuses a list that holds nothing else."""
    return not (config.num_warps == 4 and config.kwargs.get("BV") == 64 and BK < 64)


@triton.autotune(
    # From a sweep of launch configs on the H200 (dev/kernel_configs.py), each config rerun on the
    # same inputs and matched bit for bit: 4 warps without software pipelining is fastest.
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
             for bv, nw, ns in ((128, 4, 1), (64, 4, 1), (64, 8, 3))],
    key=["SIZE", "H", "HV", "K", "V", "BK", "VEC", "STATE_V_FIRST"],
    # (64, 4 warps) is miscompiled with key blocks narrower than 64: see wy_config_ok
    prune_configs_by={"early_config_prune": lambda configs, nargs, **kw: [
        c for c in configs if wy_config_ok(nargs["BK"] if "BK" in nargs else kw["BK"], c)]},
)
@triton.jit(do_not_specialize=["T", "SIZE"])
def rewy_kda_bwd_wy_kernel(
    q, k, v, v_new, g, beta, wg, A, h, dh, do, dv2,
    dq, dk, dv, dG, db, dw, dL,
    cu_seqlens, chunk_indices, chunk_order, scale, T, SIZE,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
    VEC: tl.constexpr, STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, WPREC: tl.constexpr,
    FULL_T: tl.constexpr,
):
    # The NK + 1 programs of one chunk are adjacent in launch order, so the chunk's tiles that several of
    # them read (dVn, dO, Vn, A, q, k, g) come from L2 for all but the first.
    i_t, i_k, i_bh = tl.program_id(0) // (NK + 1), tl.program_id(0) % (NK + 1), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_t = tl.load(chunk_order + i_t).to(tl.int32)   # this launch's program -> its chunk in FLA's table
        i_tg = i_t.to(tl.int64)
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_tg = (i_b * tl.cdiv(T, BT) + i_t).to(tl.int64)
        bos = i_b.to(tl.int64) * T

    # Scalar 64-bit bases at the chunk's first token; 32-bit offsets inside the tile
    # (int64 offset tiles cost twice the registers).
    tok0 = bos + i_t * BT
    row_hv = tok0 * HV + i_hv
    v += row_hv * V
    v_new += row_hv * V
    do += row_hv * V
    dv2 += row_hv * V
    dv += row_hv * V
    A += row_hv * BT
    dL += row_hv * BT
    g += row_hv * K
    dq += row_hv * K
    dk += row_hv * K
    dG += row_hv * K
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K
    if VEC:
        beta += row_hv * K
        db += row_hv * K
        wg += row_hv * V
        dw += row_hv * V
    else:
        beta += row_hv
        db += row_hv * (NK + 1)
    h += (i_tg * HV + i_hv) * K * V
    dh += (i_tg * HV + i_hv) * K * V

    o_r = tl.arange(0, BT)
    # FULL_T: every chunk has BT rows; with block widths that divide K and V the masks are constants
    m_t = bounds_mask(i_t * BT + o_r, T, FULL_T)
    if FULL_T:
        last = BT - 1                                 # last valid row of the chunk
    else:
        last = tl.minimum(T - i_t * BT, BT) - 1
    m_AT = m_t[None, :] & m_t[:, None]

    if i_k < NK:
        # ---- key side: one block of BK key channels ----
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = bounds_mask(o_k, K, K % BK == 0)
        m_tk = m_t[:, None] & m_k[None, :]
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)    # dVn h^T  (= -dW)
        b_dqg = tl.zeros([BT, BK], dtype=tl.float32)   # dO h^T
        b_dkc = tl.zeros([BT, BK], dtype=tl.float32)   # Vn dh^T
        b_dgc = tl.zeros([BK], dtype=tl.float32)       # sum_v h * dh
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = bounds_mask(o_v, V, V % BV == 0)
            m_tv = m_t[:, None] & m_v[None, :]
            off_tv = o_r[:, None] * (HV * V) + o_v[None, :]
            if STATE_V_FIRST:
                off_h = o_v[:, None] * K + o_k[None, :]
            else:
                off_h = o_v[:, None] + o_k[None, :] * V
            m_vk = m_v[:, None] & m_k[None, :]
            b_h = tl.load(h + off_h, mask=m_vk, other=0.0)           # [BV, BK]
            b_dh = tl.load(dh + off_h, mask=m_vk, other=0.0)
            b_dvn = tl.load(dv2 + off_tv, mask=m_tv, other=0.0)
            b_dw += tl.dot(b_dvn, b_h.to(b_dvn.dtype))
            b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
            b_dqg += tl.dot(b_do, b_h.to(b_do.dtype))
            b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0)
            b_dkc += tl.dot(b_vn, b_dh.to(b_vn.dtype))
            b_dgc += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)

        off_qk = o_r[:, None] * (H * K) + o_k[None, :]
        off_k = o_r[:, None] * (HV * K) + o_k[None, :]
        b_g = tl.load(g + off_k, mask=m_tk, other=0.0).to(tl.float32)
        b_e = exp2_where(m_tk, b_g)                   # e^G
        # dq (inter-chunk part), from o = scale (q e^G) h.
        b_dq = scale * b_dqg * b_e
        tl.store(dq + off_k, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        b_q = tl.load(q + off_qk, mask=m_tk, other=0.0).to(tl.float32)
        # Gate terms before the cumulative sum: +operand*gradient for every
        # e^{+G} factor, - for e^{-G}; G_C collects the state decay and the k e^{G_C} rows.
        b_dG = b_q * b_dq
        # Residual WY, key half: dX = A^T dW = -A^T (dVn h^T); A^T read transposed.
        b_AT = tl.load(A + o_r[None, :] * (HV * BT) + o_r[:, None], mask=m_AT, other=0.0)
        if WPREC == "bf16":
            b_dxe = -tl.dot(b_AT, b_dw.to(b_AT.dtype)) * b_e   # gradient wrt a = b*k through X = a e^G
        else:
            b_dxe = -tl.dot(b_AT.to(tl.float32), b_dw, input_precision=WPREC) * b_e
        b_k = tl.load(k + off_qk, mask=m_tk, other=0.0).to(tl.float32)
        if VEC:
            b_b = tl.load(beta + off_k, mask=m_tk, other=0.0).to(tl.float32)
            tl.store(db + off_k, (b_k * b_dxe).to(db.dtype.element_ty), mask=m_tk)
        else:
            b_b = tl.load(beta + o_r * HV, mask=m_t, other=0.0).to(tl.float32)[:, None]
            tl.store(db + o_r * (HV * (NK + 1)) + i_k, tl.sum(b_k * b_dxe, axis=1).to(db.dtype.element_ty),
                     mask=m_t)
        b_dk = b_b * b_dxe
        b_dG += b_b * b_k * b_dxe
        b_gc = tl.load(g + last * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_dkc = b_dkc * exp2_where(m_tk, b_gc[None, :] - b_g)      # d(k e^{G_C-G}) * e^{G_C-G}
        b_dk += b_dkc
        tl.store(dk + off_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        # These terms' share of the gate gradient, summed over the chunk here: q e^G and X = a e^G
        # depend on g_s for s <= i (a sum from the chunk's end); k_i e^{G_C - G_i} on g_s for s > i
        # (a forward sum that leaves row i out, by a scan rather than an inclusive sum minus the
        # row, which under strong decay would keep only rounding); the carried state's e^{G_C} on
        # every g_s of the chunk.
        b_kdkc = b_k * b_dkc
        _, b_before = tl.associative_scan((b_kdkc, tl.zeros_like(b_kdkc)), axis=0, combine_fn=common.add_before)
        b_dG = tl.cumsum(tl.where(m_tk, b_dG, 0.0), axis=0, reverse=True) + b_before
        b_dG += (b_dgc * tl.exp2(b_gc))[None, :]
        tl.store(dG + off_k, b_dG.to(dG.dtype.element_ty), mask=m_tk)
    else:
        # ---- value side: dY = A^T dVn, dv, the write-gate gradient, dL = -dY Vn^T ----
        b_AT = tl.load(A + o_r[None, :] * (HV * BT) + o_r[:, None], mask=m_AT, other=0.0)
        b_dL = tl.zeros([BT, BT], dtype=tl.float32)
        b_dbv = tl.zeros([BT], dtype=tl.float32)
        if not VEC:
            b_beta = tl.load(beta + o_r * HV, mask=m_t, other=0.0).to(tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & bounds_mask(o_v, V, V % BV == 0)[None, :]
            off_tv = o_r[:, None] * (HV * V) + o_v[None, :]
            b_dvn = tl.load(dv2 + off_tv, mask=m_tv, other=0.0)
            b_dy = tl.dot(b_AT, b_dvn.to(b_AT.dtype))
            b_v = tl.load(v + off_tv, mask=m_tv, other=0.0).to(tl.float32)
            if VEC:
                b_w = tl.load(wg + off_tv, mask=m_tv, other=0.0).to(tl.float32)
                tl.store(dv + off_tv, (b_dy * b_w).to(dv.dtype.element_ty), mask=m_tv)
                tl.store(dw + off_tv, (b_dy * b_v).to(dw.dtype.element_ty), mask=m_tv)
            else:
                tl.store(dv + off_tv, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
                b_dbv += tl.sum(b_dy * b_v, axis=1)
            b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0)
            if WPREC == "bf16":
                b_dL += tl.dot(b_dy.to(b_vn.dtype), tl.trans(b_vn))
            else:
                b_dL += tl.dot(b_dy, tl.trans(b_vn.to(tl.float32)), input_precision=WPREC)
        m_L = (o_r[:, None] > o_r[None, :]) & m_AT
        b_dL = tl.where(m_L, -b_dL, 0.0)
        tl.store(dL + o_r[:, None] * (HV * BT) + o_r[None, :], b_dL.to(dL.dtype.element_ty), mask=m_t[:, None])
        if not VEC:
            tl.store(db + o_r * (HV * (NK + 1)) + NK, b_dbv.to(db.dtype.element_ty), mask=m_t)


def rewy_kda_bwd_wy(q, k, v, v_new, g, beta, A, h, dh, do, dv2, scale: float, w_gate=None,
                    state_v_first: bool = False, cu_seqlens=None, chunk_indices=None, block_k: int | None = None):
    """Stage 1 of the KDA / GDN2 local backward (see the module docstring). Shapes: q, k [B, T, H, K]; v, v_new, do,
    dv2 [B, T, HV, V]; g (log2 chunk cumsum) [B, T, HV, K]; beta [B, T, HV]
    (KDA) or the erase gate b [B, T, HV, K] with ``w_gate`` [B, T, HV, V]
    (GDN2); A [B, T, HV, 64]; h, dh [B, NT, HV, K, V] (or [.., V, K]).

    Returns the partials (dq, dk, dG) [B, T, HV, K] fp32 (dG: these terms' whole share of the gate
    gradient, already summed over the chunk), the final dv and dw
    (None for KDA) in v's and w_gate's dtype,
    the erase-gate partials (KDA: [B, T, HV, NK + 1], slot NK from the value
    side; GDN2: [B, T, HV, K]) and dL [B, T, HV, 64] fp32 (strictly lower).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = A.shape[-1]
    if BT != CHUNK:
        raise ValueError(f"chunk size {BT} != {CHUNK}")
    vec = w_gate is not None
    BK = block_k or key_block(K)
    if not any(wy_config_ok(BK, c) for c in rewy_kda_bwd_wy_kernel.configs):
        raise ValueError(f"Residual WY with {BK}-channel key blocks: 4 warps with BV = 64 need block_k >= 64 "
                         "(triton 3.6 miscompiles narrower key blocks there); use block_k=64, BV = 128 or 8 warps")
    NK = triton.cdiv(K, BK)
    NT, chunk_indices = chunk_table(T, cu_seqlens, CHUNK, chunk_indices)
    dev = q.device
    dq, dk, dG = (common.alloc((B, T, HV, K), dev) for _ in range(3))
    dv = common.alloc((B, T, HV, V), dev, v.dtype)                        # final: written in the input dtype
    dw = common.alloc((B, T, HV, V), dev, w_gate.dtype) if vec else None
    db = common.alloc((B, T, HV, K), dev) if vec else common.alloc((B, T, HV, NK + 1), dev)
    dL = common.alloc((B, T, HV, BT), dev)
    # one autotune key for every launch of the call (SIZE from all its chunks), so the short chunks'
    # launch runs the config tuned on the full ones
    for chunks, order, full in chunk_launches(T, cu_seqlens, CHUNK):
        rewy_kda_bwd_wy_kernel[(chunks * (NK + 1), B * HV)](
            q, k, v, v_new, g, beta, w_gate if vec else beta, A, h, dh, do, dv2,
            dq, dk, dv, dG, db, dw if vec else dv, dL,
            cu_seqlens, chunk_indices, order, scale, T, size_class(NT * B * HV),
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, NK=NK, VEC=vec, STATE_V_FIRST=state_v_first,
            IS_VARLEN=cu_seqlens is not None, WPREC=common.WY_PRECISION, FULL_T=full,
        )
    return dq, dk, dG, dv, dw, db, dL
