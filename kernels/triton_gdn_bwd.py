"""Triton kernel: the local ReWY backward of GDN / DeltaNet for one chunk.

One program per (chunk, batch x value head). It takes what the sequential
stages produce (FLA's state recurrence forward and backward: the states h
entering each chunk, their gradients dh leaving it, v_new = Vn and its full
gradient dv2 = dVn) and computes every input gradient of the chunk in one
pass, replacing FLA's ``chunk_bwd_dqkwg`` + ``prepare_wy_repr_bwd``:

- loop over V blocks: dW = -dVn h^T, d(q e^G) = dO h^T, dAqk = dO Vn^T,
  d(k e^{G_C-G}) = Vn dh^T, the decay term sum(h * dh), and Residual WY's
  dY = A^T dVn (giving dv, dbeta) and its share -dY U^T of dL;
- Residual WY: dX = A^T dW, dL = -(dX W^T + dY U^T) (two products in all);
- Gram Elimination: the key gradient of L from P = dL * Gamma as P K and
  P^T diag(beta) K, and the gate gradient from the same partial sums, so the
  key Gram K K^T is never formed;
- the gate gradient's reverse cumulative sum inside the chunk.

Gates arrive as FLA keeps them: chunk-local cumulative sums in log2 units
(FLA scales by 1/ln 2 and uses exp2). The gradient written to ``dg`` is with
respect to the natural-log per-token gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LN2 = 0.6931471805599453


@triton.jit
def rewy_gdn_bwd_local_kernel(
    q, k, v, v_new, w, u, g, beta, A, h, dh, do, dv2,
    dq, dk, dv, dg, db,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
):
    # Plain pointer arithmetic with masks (no block pointers): the same code
    # runs on the GPU and under the interpreter of every Triton version we use.
    # Three passes over V, each consumed before the next begins, so at most a
    # few [BT, K] tiles are live at once (one fused pass spills registers at K = 128).
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    NT = tl.cdiv(T, BT)
    o_i = tl.arange(0, BT)
    rows = i_t * BT + o_i
    valid = rows < T
    tok = (i_b * T + rows).to(tl.int64)          # flat token index
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = valid[:, None] & m_k[None, :]
    state = (((i_b * NT + i_t) * HV + i_hv) * K * V).to(tl.int64)
    row_v = (tok * HV + i_hv)[:, None] * V

    if USE_G:
        b_g = tl.load(g + tok * HV + i_hv, mask=valid, other=0.0).to(tl.float32)
        last = (i_b * T + tl.minimum(T, i_t * BT + BT) - 1).to(tl.int64)
        b_g_last = tl.load(g + last * HV + i_hv).to(tl.float32)
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
        b_g_last = 0.0
    b_beta = tl.load(beta + tok * HV + i_hv, mask=valid, other=0.0).to(tl.float32)
    b_A = tl.load(A + (tok * HV + i_hv)[:, None] * BT + o_i[None, :], mask=valid[:, None], other=0.0).to(tl.float32)

    # Pass 1: dW = -dVn h^T, dAqk = dO Vn^T, and Residual WY's value half
    # (dY = A^T dVn -> dv, dbeta; -dY U^T -> dL).
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dL = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = valid[:, None] & (o_v < V)[None, :]
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        off_tv = row_v + o_v[None, :]
        b_dvn = tl.load(dv2 + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_h = tl.load(h + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)
        b_dw += tl.dot(b_dvn, tl.trans(b_h))
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dAqk += tl.dot(b_do, tl.trans(b_vn))
        b_dy = tl.dot(tl.trans(b_A), b_dvn)
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dbeta += tl.sum(b_dy * b_v, axis=1)
        tl.store(dv + off_tv, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_u = tl.load(u + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dL += tl.dot(b_dy, tl.trans(b_u))

    # Residual WY, key half: dX = A^T dW, dL = -(dX W^T + dY U^T).
    off_wk = (tok * HV + i_hv)[:, None] * K + o_k[None, :]
    b_w = tl.load(w + off_wk, mask=m_tk, other=0.0).to(tl.float32)
    b_dx = -tl.dot(tl.trans(b_A), b_dw)
    b_dL = -(b_dL + tl.dot(b_dx, tl.trans(b_w)))

    off_qk = (tok * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + off_qk, mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0).to(tl.float32)

    # Pairwise decays, masked before exp2 so no entry can overflow.
    inside = valid[:, None] & valid[None, :]
    diff = b_g[:, None] - b_g[None, :]
    gam = tl.exp2(tl.where((o_i[:, None] > o_i[None, :]) & inside, diff, float("-inf")))
    gam_incl = tl.exp2(tl.where((o_i[:, None] >= o_i[None, :]) & inside, diff, float("-inf")))
    b_eg = tl.where(valid, tl.exp2(b_g), 0.0)
    b_ekc = tl.where(valid, tl.exp2(b_g_last - b_g), 0.0)

    # Gram Elimination: the key Gram's row/column gradients from one P, and
    # the output Gram's from P2; the gate terms come from the same sums.
    b_P = b_dL * gam
    b_da = b_dx * b_eg[:, None] + tl.dot(b_P, b_k)             # wrt a = beta * k
    b_dkg = tl.dot(tl.trans(b_P * b_beta[:, None]), b_k)       # wrt k (columns of L)
    b_P2 = b_dAqk * gam_incl * scale
    b_dkg += tl.dot(tl.trans(b_P2), b_q)
    b_dq = tl.dot(b_P2, b_k)
    b_dbeta += tl.sum(b_da * b_k, axis=1)
    b_dG = tl.sum(b_k * b_beta[:, None] * b_da - b_k * b_dkg, axis=1)

    # Pass 2: d(q e^G) = dO h^T, finishing dq.
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = valid[:, None] & (o_v < V)[None, :]
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + row_v + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_h = tl.load(h + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)
        b_dqg += tl.dot(b_do, tl.trans(b_h))
    b_dq += scale * b_dqg * b_eg[:, None]
    tl.store(dq + off_wk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    b_dG += tl.sum(b_q * b_dq, axis=1)

    # Pass 3: d(k e^{G_C - G}) = Vn dh^T and the decay term sum(h * dh), finishing dk.
    b_dkc = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgc = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = valid[:, None] & (o_v < V)[None, :]
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        b_vn = tl.load(v_new + row_v + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        off_kv = state + o_k[:, None] * V + o_v[None, :]
        b_dh = tl.load(dh + off_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_dkc += tl.dot(b_vn, tl.trans(b_dh))
        if USE_G:
            b_h = tl.load(h + off_kv, mask=m_kv, other=0.0).to(tl.float32)
            b_dgc += tl.sum(b_h * b_dh, axis=1)
    b_kc = b_k * b_ekc[:, None]
    b_dk = b_dkg + b_dkc * b_ekc[:, None] + b_da * b_beta[:, None]
    tl.store(dk + off_wk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(db + tok * HV + i_hv, b_dbeta.to(db.dtype.element_ty), mask=valid)

    if USE_G:
        b_dG -= tl.sum(b_kc * b_dkc, axis=1)
        b_dGC = tl.sum(b_dgc) * tl.exp2(b_g_last) + tl.sum(b_dkc * b_kc)
        b_dG = tl.where(valid, b_dG, 0.0)
        b_dgo = tl.cumsum(b_dG, axis=0, reverse=True) + b_dGC
        tl.store(dg + tok * HV + i_hv, b_dgo.to(dg.dtype.element_ty), mask=valid)


def rewy_gdn_bwd_local(q, k, v, v_new, w, u, g, beta, A, h, dh, do, dv2, scale: float,
                       num_warps: int = 8, num_stages: int = 2):
    """Chunk-local ReWY backward in FLA's layout.

    q, k: [B, T, H, K]; v, v_new, u, do, dv2: [B, T, HV, V]; w: [B, T, HV, K];
    g (log2-unit chunk cumsum, or None for DeltaNet), beta: [B, T, HV];
    A: [B, T, HV, 64]; h, dh: [B, NT, HV, K, V] (states entering each chunk and
    the gradients of the states leaving it). dq and dk come back per value head
    ([B, T, HV, K]); the caller sums them over each key head's group (GVA).
    """
    q, k, v, v_new, w, u, beta, A, h, dh, do, dv2 = (
        t.contiguous() for t in (q, k, v, v_new, w, u, beta, A, h, dh, do, dv2))
    g = None if g is None else g.contiguous()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = A.shape[-1]
    BK = triton.next_power_of_2(K)
    BV = min(128, triton.next_power_of_2(V))
    if BK > 256:
        raise ValueError(f"key head dim {K} > 256 is not supported by the ReWY Triton kernel")
    dq = torch.empty(B, T, HV, K, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dv_ = torch.empty(B, T, HV, V, device=q.device, dtype=torch.float32)
    dg = torch.empty(B, T, HV, device=q.device, dtype=torch.float32) if g is not None else None
    db = torch.empty(B, T, HV, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, BT), B * HV)
    rewy_gdn_bwd_local_kernel[grid](
        q, k, v, v_new, w, u, g if g is not None else beta, beta, A, h, dh, do, dv2,
        dq, dk, dv_, dg if dg is not None else db, db,
        scale, T, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_G=g is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return dq, dk, dv_, dg, db
