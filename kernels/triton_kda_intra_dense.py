"""Matrix Intra on whole chunks: an opt-in variant of stage 2 of the KDA/GDN2
backward (``triton_kda_bwd.rewy_kda_bwd_intra``), chosen with
``REWY_KDA_INTRA=dense``.

The sub-block kernel walks a chunk's four 16-row blocks and contracts [16, 16]
blocks of dAqk and dL, reloading the other blocks' q, k and gates for each
one. The H200 profile puts it at 1.6 ms of a 3.0 ms KDA backward at
(2, 8192, 16), far above what its arithmetic or its unique memory traffic
needs, which points at waiting on those small, dependent loads. This
variant loads the chunk's q, k, gates and erase gates once, as [64, BK] tiles,
and does every contraction as one [64, 64] x [64, BK] tensor-core product
whose 64 x 64 operand has the blocks it does not need masked to zero:

- row side, one product per row block I = 1..3, reference row r = 16 I:
  R[i] += e^{G_i - G_r} sum_{j < r} dM[i, j] k_j e^{G_r - G_j}, i in block I;
- column side, one per column block I = 0..2, reference e = I's last row:
  R_c[j] += e^{G_e - G_j} sum_{i > e} dM[i, j] x_i e^{G_i - G_e}, j in block I;
- the four diagonal blocks in one product: each row's reference is its own
  block's midpoint, so both factors stay within 2^{+-s/2} (s the widest
  block's gate spread; above SPAN_LIMIT every diagonal block takes the exact
  elementwise path).

Each exponent is masked before exp2 as in the sub-block kernel, so the bounds
in ``triton_kda_bwd``'s docstring hold unchanged. Its 16 products do about six
times the multiply-adds of the sub-block kernel's 40 (the masked zeros), in
exchange for M = 64 operands, fewer dependent steps and one load of each tile. Which one wins is a GPU question;
until a GPU run answers it, the sub-block kernel stays the default.

KDA's scalar erase gate: each key block writes its share of db into its own
slot of a [.., NKI] buffer, and the wrapper adds the slots to the WY kernel's
partials (two small reductions), so any number of key blocks works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_kda_bwd as base
from .triton_kda_bwd import _exp2_where


@triton.autotune(
    configs=[triton.Config({}, num_warps=nw, num_stages=1, maxnreg=r) for nw in (4, 8) for r in (None, 168)],
    key=["T", "H", "HV", "K", "BK", "VEC"],
)
@triton.jit(do_not_specialize=["T"])
def rewy_kda_intra_dense_kernel(
    q, k, g, beta, dAqk, dL, dq, dk, dG, dbp,
    dq_o, dk_o, dg_o, db_o,
    cu_seqlens, chunk_indices, T, span_limit,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, NKI: tl.constexpr, VEC: tl.constexpr, IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr, DPREC: tl.constexpr,
):
    i_t, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T

    tok0 = bos + i_t * BT
    row_hv = tok0 * HV + i_hv
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K
    g += row_hv * K
    dq += row_hv * K
    dk += row_hv * K
    dG += row_hv * K
    dq_o += row_hv * K
    dk_o += row_hv * K
    dg_o += row_hv * K
    dAqk += row_hv * BT
    dL += row_hv * BT
    if VEC:
        beta += row_hv * K
        dbp += row_hv * K
        db_o += row_hv * K
    else:
        beta += row_hv
        db_o += row_hv * NKI
    n_valid = T - i_t * BT

    o_t = tl.arange(0, BT)
    blk = o_t // BC
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_t = o_t < n_valid
    m_tk = m_t[:, None] & m_k[None, :]
    off_qk = o_t[:, None] * (H * K) + o_k[None, :]
    off_g = o_t[:, None] * (HV * K) + o_k[None, :]
    b_q = tl.load(q + off_qk, mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0).to(tl.float32)
    b_g = tl.load(g + off_g, mask=m_tk, other=0.0).to(tl.float32)
    if VEC:
        b_b = tl.load(beta + off_g, mask=m_tk, other=0.0).to(tl.float32)
    else:
        b_b = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)[:, None]
    b_x = b_b * b_k                                   # a = b*k, the rows of L
    off_a = o_t[:, None] * (HV * BT) + o_t[None, :]
    m_tt = m_t[:, None] & m_t[None, :]
    b_dA = tl.load(dAqk + off_a, mask=m_tt, other=0.0).to(tl.float32)
    b_dA = tl.where(o_t[:, None] >= o_t[None, :], b_dA, 0.0)
    b_dL = tl.load(dL + off_a, mask=m_tt, other=0.0).to(tl.float32)
    b_dL = tl.where(o_t[:, None] > o_t[None, :], b_dL, 0.0)

    b_Rq = tl.zeros([BT, BK], dtype=tl.float32)       # d/dq of Aqk (scale inside dAqk)
    b_Ra = tl.zeros([BT, BK], dtype=tl.float32)       # d/da of L (rows)
    b_Rc = tl.zeros([BT, BK], dtype=tl.float32)       # d/dk as the column factor of L and Aqk

    # Row side: rows of block I against every earlier column, reference r = first row of I.
    for I in tl.static_range(1, BT // BC):
        if I * BC < n_valid:
            b_gr = tl.load(g + (I * BC) * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
            m_col = o_t < I * BC
            b_kf = b_k * _exp2_where(m_col[:, None] & m_k[None, :], b_gr[None, :] - b_g)    # <= 1
            m_row = (blk == I) & m_t
            sel = m_row[:, None] & m_col[None, :]
            acc_q = tl.dot(tl.where(sel, b_dA, 0.0), b_kf, input_precision=PREC)
            acc_a = tl.dot(tl.where(sel, b_dL, 0.0), b_kf, input_precision=PREC)
            b_er = _exp2_where(m_row[:, None] & m_k[None, :], b_g - b_gr[None, :])         # <= 1
            b_Rq += acc_q * b_er
            b_Ra += acc_a * b_er

    # Column side: columns of block I against every later row, reference e = last row of I
    # (all of block I is valid whenever a later row is).
    for I in tl.static_range(0, BT // BC - 1):
        if (I + 1) * BC < n_valid:
            b_ge = tl.load(g + (I * BC + BC - 1) * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
            m_row = (blk > I) & m_t
            b_f = _exp2_where(m_row[:, None] & m_k[None, :], b_g - b_ge[None, :])          # <= 1
            m_col = blk == I
            sel = m_row[:, None] & m_col[None, :]
            acc_c = tl.dot(tl.trans(tl.where(sel, b_dA, 0.0)), b_q * b_f, input_precision=PREC)
            acc_c += tl.dot(tl.trans(tl.where(sel, b_dL, 0.0)), b_x * b_f, input_precision=PREC)
            b_Rc += acc_c * _exp2_where(m_col[:, None] & m_k[None, :], b_ge[None, :] - b_g)  # <= 1

    # Diagonal blocks: each row's reference is its block's midpoint, per channel.
    NB: tl.constexpr = BT // BC
    hi = tl.max(tl.reshape(tl.where(m_tk, b_g, float("-inf")), [NB, BC, BK]), axis=1)
    lo = tl.min(tl.reshape(tl.where(m_tk, b_g, float("inf")), [NB, BC, BK]), axis=1)
    live = (hi >= lo) & m_k[None, :]                  # blocks with valid rows, real channels
    span = tl.max(tl.max(tl.where(live, hi - lo, 0.0), axis=1), axis=0)
    same = blk[:, None] == blk[None, :]
    if span <= span_limit:
        mid = tl.where(live, 0.5 * (hi + lo), 0.0)
        mid_rows = tl.reshape(tl.broadcast_to(mid[:, None, :], [NB, BC, BK]), [BT, BK])
        b_ep = _exp2_where(m_tk, b_g - mid_rows)      # in [2^{-s/2}, 2^{s/2}]
        b_en = _exp2_where(m_tk, mid_rows - b_g)
        b_dAd = tl.where(same, b_dA, 0.0)
        b_dLd = tl.where(same, b_dL, 0.0)
        b_kn = b_k * b_en
        b_Rq += tl.dot(b_dAd, b_kn, input_precision=DPREC) * b_ep
        b_Ra += tl.dot(b_dLd, b_kn, input_precision=DPREC) * b_ep
        b_Rc += (tl.dot(tl.trans(b_dLd), b_x * b_ep, input_precision=DPREC)
                 + tl.dot(tl.trans(b_dAd), b_q * b_ep, input_precision=DPREC)) * b_en
    else:
        for t in range(0, tl.minimum(BT, n_valid)):
            b_kt = tl.load(k + t * (H * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_qt = tl.load(q + t * (H * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_gt = tl.load(g + t * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
            if VEC:
                b_bt = tl.load(beta + t * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
            else:
                b_bt = tl.load(beta + t * HV).to(tl.float32)
            col_q = tl.load(dAqk + o_t * (HV * BT) + t, mask=m_t, other=0.0).to(tl.float32)
            col_l = tl.load(dL + o_t * (HV * BT) + t, mask=m_t, other=0.0).to(tl.float32)
            row_q = tl.load(dAqk + t * (HV * BT) + o_t).to(tl.float32)
            row_l = tl.load(dL + t * (HV * BT) + o_t).to(tl.float32)
            in_blk = m_t & (blk == t // BC)
            # rows i >= t of t's block: e^{G_i - G_t} <= 1
            m_lo = in_blk & (o_t >= t)
            b_xe = _exp2_where(m_lo[:, None] & m_k[None, :], b_g - b_gt[None, :])
            b_Rq += tl.where(m_lo, col_q, 0.0)[:, None] * b_kt[None, :] * b_xe
            b_Ra += tl.where(m_lo & (o_t > t), col_l, 0.0)[:, None] * b_kt[None, :] * b_xe
            # columns j <= t of t's block: e^{G_t - G_j} <= 1
            m_up = in_blk & (o_t <= t)
            b_ye = _exp2_where(m_up[:, None] & m_k[None, :], b_gt[None, :] - b_g)
            b_Rc += (tl.where(m_up & (o_t < t), row_l, 0.0)[:, None] * (b_bt * b_kt)[None, :]
                     + tl.where(m_up, row_q, 0.0)[:, None] * b_qt[None, :]) * b_ye

    # Assemble: the WY kernel's inter-chunk partials plus the Gram terms.
    b_dq = tl.load(dq + off_g, mask=m_tk, other=0.0) + b_Rq
    tl.store(dq_o + off_g, b_dq.to(dq_o.dtype.element_ty), mask=m_tk)
    b_dk = tl.load(dk + off_g, mask=m_tk, other=0.0) + b_b * b_Ra + b_Rc
    tl.store(dk_o + off_g, b_dk.to(dk_o.dtype.element_ty), mask=m_tk)
    b_dG = tl.load(dG + off_g, mask=m_tk, other=0.0) + b_x * b_Ra + b_q * b_Rq - b_k * b_Rc
    b_dG = tl.where(m_tk, b_dG, 0.0)
    b_dg = tl.cumsum(b_dG, axis=0, reverse=True)      # the whole chunk at once: no carry
    tl.store(dg_o + off_g, b_dg.to(dg_o.dtype.element_ty), mask=m_tk)
    if VEC:
        b_db = tl.load(dbp + off_g, mask=m_tk, other=0.0) + b_k * b_Ra
        tl.store(db_o + off_g, b_db.to(db_o.dtype.element_ty), mask=m_tk)
    else:
        tl.store(db_o + o_t * (HV * NKI) + i_k, tl.sum(b_k * b_Ra, axis=1), mask=m_t)


def rewy_kda_intra_dense(q, k, g, beta, dAqk, dL, dq, dk, dG, db_part, cu_seqlens=None, chunk_indices=None,
                         inplace: bool = True, span_limit: float = base.SPAN_LIMIT, block_k: int | None = None,
                         dqk_dtype: torch.dtype | None = None, db_dtype: torch.dtype | None = None):
    """Same contract as ``triton_kda_bwd.rewy_kda_bwd_intra``: the final
    (dq, dk, dg, db) from the WY kernel's partials, dL and dAqk."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    vec = beta.dim() == 4
    BT = dAqk.shape[-1]
    BK = block_k or min(64, max(16, triton.next_power_of_2(K)))
    NKI = triton.cdiv(K, BK)
    NT, chunk_indices = base._varlen(cu_seqlens, chunk_indices, T, B)
    dev = q.device
    out = (lambda dt: base._alloc((B, T, HV, K), dev, dt or torch.float32))
    dq_o = dq if inplace and dqk_dtype is None else out(dqk_dtype)
    dk_o = dk if inplace and dqk_dtype is None else out(dqk_dtype)
    dg_o = dG if inplace else out(None)
    if vec:
        db_o = db_part if inplace and db_dtype is None else out(db_dtype)
    else:
        db_o = base._alloc((B, T, HV, NKI), dev)      # one slot per key block
    rewy_kda_intra_dense_kernel[(NT, B * HV, NKI)](
        q, k, g, beta, dAqk, dL, dq, dk, dG, db_part,
        dq_o, dk_o, dg_o, db_o,
        cu_seqlens, chunk_indices, T, float(span_limit),
        H=H, HV=HV, K=K, BT=BT, BC=base.BC_SUB, BK=BK, NKI=NKI, VEC=vec,
        IS_VARLEN=cu_seqlens is not None, PREC=base.INTRA_PRECISION, DPREC=base.DIAG_PRECISION,
    )
    if not vec:
        db_o = db_part.sum(-1) + db_o.sum(-1)
    return dq_o, dk_o, dg_o, db_o
