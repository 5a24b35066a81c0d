"""Triton kernel: the local ReWY backward of GDN / DeltaNet.

One program per (key block, chunk, batch x value head). It takes what the
sequential stages produce (FLA's state recurrence forward and backward: the
states h entering each chunk, their gradients dh leaving it, v_new = Vn and
its full gradient dv2 = dVn) and computes every input gradient of the chunk
in one pass, replacing FLA's ``chunk_bwd_dqkwg`` + ``prepare_wy_repr_bwd``
and the sums and reverse cumsum between them.

- Residual WY collapses further here. Vn = U - W h, so the key half of the
  residual, dX W^T = A^T dW W^T = -A^T dVn (W h)^T, equals -dY (U - Vn)^T with
  dY = A^T dVn, and dL = -(dX W^T + dY U^T) = -dY Vn^T. dL needs no
  contraction over K, so each key block computes it whole from the value
  tiles, and W, U are never read.
- Per key block: dW = -dVn h^T, d(q e^G) = dO h^T, d(k e^{G_C-G}) = Vn dh^T,
  the decay term sum(h * dh), and dX = A^T dW.
- dX takes the same shortcut as dL: dX = A^T dW = -(A^T dVn) h^T = -dY h^T,
  so the loop accumulates dY h^T from the dY it already forms for dL, in
  place of dVn h^T, and the end phase has no product A^T dW (fewer spills
  and instructions than forming dX after the loop).
- Gram Elimination: the key gradient of L from P = dL * Gamma as P K and
  P^T diag(beta) K, and the gate gradient from the same partial sums, so the
  key Gram K K^T is never formed.
- The gate gradient's reverse cumulative sum inside the chunk is linear, so
  each key block writes its own share and the caller adds the NK shares.
- After the loop over V, the products that finish dq, dk (P K,
  P^T diag(beta) K, P2 K, P2^T Q) take operands in the inputs' dtype (BF16
  in training), as FLA's ``chunk_bwd_dqkwg`` and WY backward do, and each
  fp32 accumulator is consumed at its last use: fp32 (tf32) operands would
  hold fp32 copies of q, k and A in registers and spill.

Gates arrive as FLA keeps them: chunk-local cumulative sums in log2 units
(FLA scales by 1/ln 2 and uses exp2). The gradient written to ``dg`` is with
respect to the natural-log per-token gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunks import chunk_launches
from ..launch import launch
from ..tiles import bounds_mask

# Four configs: the first cold call of each (K, V, gate) tunes them all, and compile time is paid per
# config. Chosen from a sweep of launch configs on the H200 at (2, 8192, 16), K = V = 128
# (dev/kernel_configs.py): every 8-warp config was slower, and the best config outside this list
# was within 1 % of the best inside it.
_CONFIGS = [triton.Config({"BV": bv}, num_warps=4, num_stages=ns) for bv, ns in ((32, 3), (32, 2), (64, 1), (128, 2))]


def _prune(configs, named_args, **kwargs):
    # A value block wider than V only adds masked work.
    V = named_args["V"] if "V" in named_args else kwargs["V"]
    kept = [c for c in configs if c.kwargs["BV"] <= max(64, triton.next_power_of_2(V))]
    return kept or configs[:1]


@triton.autotune(configs=_CONFIGS, key=["K", "V", "BT", "USE_G"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def rewy_gdn_bwd_local_kernel(
    q, k, v, v_new, g, beta, A, h, dh, do, dv2,
    dq, dk, dv, dg, db,
    cu_seqlens, chunk_indices, chunk_order,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    FULL_T: tl.constexpr,
):
    # Plain pointer arithmetic with masks (no block pointers): the same code
    # runs on the GPU and under the interpreter of every Triton version we use.
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    B = tl.num_programs(2) // HV
    if IS_VARLEN:
        # Packed sequences (B = 1): program i_c serves chunk order[i_c] of FLA's table, chunk i_t of
        # sequence i_n; the chunk states are stored in that table's order.
        i_c = tl.load(chunk_order + i_c).to(tl.int32)
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        T_seq = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        chunk = i_c
    else:
        i_t = i_c
        bos = i_b * T
        T_seq = T
        chunk = i_b * tl.cdiv(T, BT) + i_t
    o_i = tl.arange(0, BT)
    # FULL_T: every chunk has BT rows; with block widths that divide K and V the masks are constants
    valid = bounds_mask(i_t * BT + o_i, T_seq, FULL_T)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = bounds_mask(o_k, K, K % BK == 0)
    m_tk = valid[:, None] & m_k[None, :]
    # Scalar 64-bit bases at the chunk's first token (and its state); 32-bit offsets inside the
    # chunk, which take half the registers and address instructions of 64-bit offset tiles.
    tok0 = (bos + i_t * BT).to(tl.int64)
    row_hv = tok0 * HV + i_hv
    g += row_hv
    beta += row_hv
    A += row_hv * BT
    v += row_hv * V
    v_new += row_hv * V
    do += row_hv * V
    dv2 += row_hv * V
    dv += row_hv * V
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K
    dq += row_hv * K
    dk += row_hv * K
    part = (i_k.to(tl.int64) * B * T + tok0) * HV + i_hv   # this key block's share of db and dg
    db += part
    dg += part
    state = (chunk.to(tl.int64) * HV + i_hv) * K * V
    h += state
    dh += state
    row_v = (o_i * HV)[:, None] * V
    first = i_k == 0                              # writes the key-independent outputs

    if USE_G:
        b_g = tl.load(g + o_i * HV, mask=valid, other=0.0).to(tl.float32)
        if FULL_T:
            last = BT - 1
        else:
            last = tl.minimum(T_seq - i_t * BT, BT) - 1   # last valid row of the chunk
        b_g_last = tl.load(g + last * HV).to(tl.float32)
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
        b_g_last = 0.0
    b_beta = tl.load(beta + o_i * HV, mask=valid, other=0.0).to(tl.float32)
    b_A = tl.load(A + (o_i * HV)[:, None] * BT + o_i[None, :], mask=valid[:, None], other=0.0)
    b_At = tl.trans(b_A)

    # One pass over V. Key-independent: dY = A^T dVn (-> dv, dbeta), dAqk = dO Vn^T,
    # dY Vn^T (-> dL). Per key block: dY h^T (= A^T dVn h^T), dO h^T, Vn dh^T, sum(h * dh).
    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dyvn = tl.zeros([BT, BT], dtype=tl.float32)
    b_dhw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkc = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgc = tl.zeros([BK], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = bounds_mask(o_v, V, V % BV == 0)
        m_tv = valid[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        off_tv = row_v + o_v[None, :]
        off_kv = o_k[:, None] * V + o_v[None, :]
        b_dvn = tl.load(dv2 + off_tv, mask=m_tv, other=0.0)
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0)
        b_h = tl.load(h + off_kv, mask=m_kv, other=0.0).to(b_do.dtype)
        b_dh = tl.load(dh + off_kv, mask=m_kv, other=0.0).to(b_vn.dtype)
        b_dy = tl.dot(b_At, b_dvn.to(b_At.dtype))
        b_dy_lp = b_dy.to(b_vn.dtype)
        b_dAqk += tl.dot(b_do, tl.trans(b_vn))
        b_dyvn += tl.dot(b_dy_lp, tl.trans(b_vn))
        b_dhw += tl.dot(b_dy_lp, tl.trans(b_h))
        b_dqg += tl.dot(b_do, tl.trans(b_h))
        b_dkc += tl.dot(b_vn, tl.trans(b_dh))
        if USE_G:
            b_dgc += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        if first:
            b_v = tl.load(v + off_tv, mask=m_tv, other=0.0).to(tl.float32)
            b_dbeta += tl.sum(b_dy * b_v, axis=1)
            tl.store(dv + off_tv, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)

    # The end phase consumes one accumulator at a time (each dies at its last use), and its
    # products take 16-bit operands, as FLA's do, so the phase needs no fp32 copy of q, k or A.
    off_qk = (o_i * H)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + off_qk, mask=m_tk, other=0.0)
    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)
    lp = b_k.dtype
    off_out = (o_i * HV)[:, None] * K + o_k[None, :]

    # Pairwise decays of the strictly lower triangle, masked before exp2 so no entry can overflow. The
    # output Gram's diagonal (decay e^0 = 1) is added apart: it carries no gate, and keeping it out of
    # the gate gradient keeps that gradient from being the small difference of two large terms when
    # the decay is strong (a log-gate of -10 per token spans e^-640 in one chunk).
    diff = b_g[:, None] - b_g[None, :]
    below = (o_i[:, None] > o_i[None, :]) & (valid[:, None] & valid[None, :])
    gam = tl.exp2(tl.where(below, diff, float("-inf")))
    b_eg = tl.where(valid, tl.exp2(b_g), 0.0)
    b_diag = scale * tl.sum(tl.where(o_i[:, None] == o_i[None, :], b_dAqk, 0.0), axis=1)

    # Output side: P2 = dAqk * Gamma -> dq and q's share of dk.
    b_P2 = (b_dAqk * gam * scale).to(lp)
    b_dq = tl.dot(b_P2, b_k) + scale * b_dqg * b_eg[:, None]
    b_dG = tl.sum(b_q.to(tl.float32) * b_dq, axis=1)
    b_dq += b_diag[:, None] * b_k.to(tl.float32)
    tl.store(dq + off_out, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    b_dkg = tl.dot(tl.trans(b_P2), b_q)

    # Key side: dX = A^T dW = -dY h^T (the loop's sum); P = dL * Gamma (strictly lower), dL = -dY Vn^T
    # (see the module docstring); Gram Elimination takes the key Gram's row and column
    # gradients from P, and the gate terms from the same sums.
    b_da = -b_dhw * b_eg[:, None]
    b_P = -b_dyvn * gam
    b_da += tl.dot(b_P.to(lp), b_k)                               # wrt a = beta * k
    b_dkg += tl.dot(tl.trans((b_P * b_beta[:, None]).to(lp)), b_k)
    b_kf = b_k.to(tl.float32)
    b_dbeta += tl.sum(b_da * b_kf, axis=1)
    tl.store(db + o_i * HV, b_dbeta, mask=valid)
    b_dkc = b_dkc * tl.where(valid, tl.exp2(b_g_last - b_g), 0.0)[:, None]
    if USE_G:
        # A Gram term e^{G_i - G_j} depends on g_s for j < s <= i: it enters at its row with its operand
        # times its gradient and leaves at its column with the negative, so a sum from the chunk's end
        # keeps only the terms that span s. k_i e^{G_C - G_i} and the carried state's e^{G_C} depend on
        # g_s for s > i: their terms enter through a forward sum that excludes the row itself (a
        # strictly lower masked sum, not an inclusive sum minus the row), so no term is added and taken
        # away again.
        b_dG += tl.sum(b_kf * (b_beta[:, None] * b_da - b_dkg), axis=1)
        b_dG = tl.where(valid, b_dG, 0.0)
        b_kc = tl.where(valid, tl.sum(b_dkc * b_kf, axis=1), 0.0)
        b_before = tl.sum(tl.where(o_i[:, None] > o_i[None, :], b_kc[None, :], 0.0), axis=1)
        b_dGC = tl.sum(b_dgc) * tl.exp2(b_g_last)
        tl.store(dg + o_i * HV, tl.cumsum(b_dG, axis=0, reverse=True) + b_before + b_dGC, mask=valid)
    b_dk = b_dkg + b_diag[:, None] * b_q.to(tl.float32) + b_dkc + b_da * b_beta[:, None]
    tl.store(dk + off_out, b_dk.to(dk.dtype.element_ty), mask=m_tk)


def rewy_gdn_bwd_local(q, k, v, v_new, g, beta, A, h, dh, do, dv2, scale: float,
                       cu_seqlens=None, chunk_indices=None, block_k: int | None = None):
    """Chunk-local ReWY backward in FLA's layout.

    q, k: [B, T, H, K]; v, v_new, do, dv2: [B, T, HV, V]; g (log2-unit chunk
    cumsum, or None for DeltaNet), beta: [B, T, HV]; A: [B, T, HV, 64];
    h, dh: [B, NT, HV, K, V] (states entering each chunk and the gradients of
    the states leaving it). With ``cu_seqlens`` (B = 1, packed sequences),
    ``chunk_indices`` is FLA's [NT_total, 2] table of (sequence, chunk) and h, dh
    are [1, NT_total, HV, K, V]. dq and dk come back per value head
    ([B, T, HV, K]); the caller sums them over each key head's group (GVA).
    ``block_k``: key channels per program, 64 (the default) or 128 (each key
    block repeats the key-independent value-side products); narrower blocks are
    refused, as triton 3.6.0 miscompiles them (K < 64 runs masked 64-wide blocks).
    """
    q, k, v, v_new, beta, A, h, dh, do, dv2 = (
        t.contiguous() for t in (q, k, v, v_new, beta, A, h, dh, do, dv2))
    g = None if g is None else g.contiguous()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = A.shape[-1]
    if K > 256:
        raise ValueError(f"key head dim {K} > 256 is not supported by the ReWY Triton kernel")
    # Key blocks are 64 wide even where K is narrower (masked): at 32, triton 3.6.0 on the H200
    # gave outputs that changed with the launch config by up to 3 %.
    BK = block_k or 64
    if BK < 64:
        raise ValueError(f"block_k={BK}: key blocks narrower than 64 are miscompiled by triton 3.6 in this kernel; "
                         "use 64 (the default) or 128")
    NK = triton.cdiv(K, BK)
    # Gradients leave in the input dtype (accumulation is float32 in-kernel) unless the
    # caller must still sum value heads into key heads (GVA): fp32 copies cost peak memory.
    dqk_dtype = q.dtype if HV == H else torch.float32
    dq = torch.empty(B, T, HV, K, device=q.device, dtype=dqk_dtype)
    dk = torch.empty_like(dq)
    dv_ = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    # Each key block's share of beta's gradient (and the gate's), in one buffer, so that one
    # reduction adds them: a launch fewer per backward than one sum each.
    shares = torch.empty(1 + (g is not None), NK, B, T, HV, device=q.device, dtype=torch.float32)
    dg, db = (shares[0] if g is not None else None), shares[-1]
    varlen = cu_seqlens is not None
    if varlen and (B != 1 or chunk_indices is None):
        raise ValueError("packed sequences (cu_seqlens) need B = 1 and FLA's chunk_indices")
    for chunks, order, full in chunk_launches(T, cu_seqlens, BT):
        launch(
            rewy_gdn_bwd_local_kernel, (NK, chunks, B * HV), q=q, k=k, v=v, v_new=v_new,
            g=g if g is not None else beta, beta=beta, A=A, h=h, dh=dh, do=do, dv2=dv2, dq=dq, dk=dk, dv=dv_,
            dg=dg if dg is not None else db, db=db, cu_seqlens=cu_seqlens if varlen else beta,
            chunk_indices=chunk_indices if varlen else beta, chunk_order=order if varlen else beta,
            scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, USE_G=g is not None, IS_VARLEN=varlen,
            FULL_T=full,
        )
    total = shares.sum(1) if NK > 1 else shares[:, 0]
    return dq, dk, dv_, total[0] if g is not None else None, total[-1]
