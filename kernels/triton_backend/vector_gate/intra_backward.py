"""Triton kernel: the intra-chunk Gram backward of KDA / GDN2 by Matrix Intra (stage 2 of 2).

Grid (chunks x K blocks, batch x value heads). The gated-Gram backward of L
(rows a = b*k, columns k) and of Aqk (rows q, columns k), over the chunk's
four 16-row sub-blocks (last first), plus the assembly of the final dq, dk,
db and the gate gradient with its reverse cumulative sum inside the chunk,
carried across sub-blocks (Gram Elimination: dG = a*Ra + q*Rq - k*Rc, from
the row/column gradients the key gradient needs anyway, with Aqk's diagonal
added to dq and dk apart; L is never rebuilt), added to stage 1's share.
It updates stage 1's partials in place (wy_backward.py). KDA's db: the first
K block folds in stage 1's slots; with one K block that is the final db, with
several each block writes its share to its own slot of a new [.., NKI]
buffer and the caller sums them (one small reduction).

The loop over sub-blocks is latency-bound and its products are small
([16, 16] x [16, BK]), so each program runs two warps with the J loops
software-pipelined.

Matrix Intra and the gate bound. For a sub-block I of 16 rows and columns j
in an earlier sub-block, e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j} with r
the first row of I (row side) or the last row of the column block (column
side). With non-positive log-gates (every FLA gate activation) both factors
are <= 1, so every off-diagonal block is one tensor-core ``tl.dot`` of
bounded operands; a factor that underflows belongs to an entry that is
itself below 2^-126. The four 16 x 16 diagonal blocks use, per key channel,
the midpoint m of the block's cumulative gates as reference: both factors
lie in [2^{-s/2}, 2^{s/2}] where s = max - min of the block's cumulative
log2-gate. The tensor-core diagonal path is taken when s <= ``SPAN_LIMIT``
(120 in log2 units = 83 nats over the block's 15 gate steps; FLA's
``safe_gate`` range lower_bound >= -5 gives at most 75 nats, and
log-sigmoid gates far less). A block beyond it takes an exact elementwise
path whose exponents are masked to the causal part before ``exp2``, so the
kernel is correct for any non-positive gates; the bound only decides speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...constants import CHUNK
from ..chunks import chunk_launches, chunk_table
from ..tiles import bounds_mask, size_class
from . import common
from .common import SUB_BLOCK, dot_prec, exp2_where


@triton.autotune(
    # Its tiles are [16, BK]: two warps cover them, and num_stages > 1 lets Triton prefetch the next
    # sub-block of the J loops while multiplying this one (the fastest configs of a sweep on the H200).
    configs=[triton.Config({}, num_warps=nw, num_stages=ns) for nw, ns in ((2, 3), (2, 2), (4, 3))],
    key=["SIZE", "H", "HV", "K", "BK", "VEC", "NDB", "NKI"],
    # the kernel updates its partial inputs in place: benchmarking configs must not accumulate
    restore_value=["dq", "dk", "dG", "dbp"],
)
@triton.jit(do_not_specialize=["T", "SIZE"])
def rewy_kda_bwd_intra_kernel(
    q, k, g, beta, dAqk, dL, dq, dk, dG, dbp,
    dq_o, dk_o, dg_o, db_o,
    cu_seqlens, chunk_indices, chunk_order, T, SIZE, span_limit,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, NC: tl.constexpr, NDB: tl.constexpr, NKI: tl.constexpr, VEC: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, DPREC: tl.constexpr, FULL_T: tl.constexpr,
):
    # the key blocks of one chunk are adjacent in launch order: they share its dAqk and dL tiles through L2
    i_t, i_k, i_bh = tl.program_id(0) // NKI, tl.program_id(0) % NKI, tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_t = tl.load(chunk_order + i_t).to(tl.int32)   # this launch's program -> its chunk in FLA's table
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T

    # Scalar 64-bit bases at the chunk's first token; 32-bit offsets inside it.
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
        dbp += row_hv * NDB
        db_o += row_hv * NKI
    n_valid = T - i_t * BT                          # valid rows in this chunk (may exceed BT)
    NARROW: tl.constexpr = q.dtype.element_ty       # operand dtype of the off-diagonal products under PREC "bf16"

    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    # constant masks (tiles.py): over K where BK divides it, over rows where every chunk of the launch is full
    m_k = bounds_mask(o_k, K, K % BK == 0)
    carry = tl.zeros([BK], dtype=tl.float32)       # sum of the gate terms of later rows
    # Last sub-block first, so the reverse cumulative sum can carry across blocks.
    # A runtime loop (not unrolled): unrolling the four blocks and their inner
    # loops multiplies live registers.
    for ii in range(0, NC):
        I = NC - 1 - ii
        if I * BC < n_valid:
            r_i = I * BC + o_c                      # rows of block I within the chunk
            m_i = bounds_mask(r_i, n_valid, FULL_T)
            m_ik = m_i[:, None] & m_k[None, :]
            off_k = r_i[:, None] * (HV * K) + o_k[None, :]
            b_g = tl.load(g + off_k, mask=m_ik, other=0.0).to(tl.float32)
            b_Rq = tl.zeros([BC, BK], dtype=tl.float32)   # d/dq of Aqk (scale inside dAqk)
            b_Ra = tl.zeros([BC, BK], dtype=tl.float32)   # d/da of L, a = b*k (rows)
            b_Rc = tl.zeros([BC, BK], dtype=tl.float32)   # d/dk as the column factor of L and Aqk

            # Row side, columns of earlier blocks: reference = first row r of block I.
            if I > 0:
                b_gr = tl.load(g + (I * BC) * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
                acc_q = tl.zeros([BC, BK], dtype=tl.float32)
                acc_a = tl.zeros([BC, BK], dtype=tl.float32)
                for J in range(0, I):
                    r_j = J * BC + o_c                  # all before r, so all valid
                    b_kj = tl.load(k + r_j[:, None] * (H * K) + o_k[None, :], mask=m_k[None, :],
                                   other=0.0).to(tl.float32)
                    b_gj = tl.load(g + r_j[:, None] * (HV * K) + o_k[None, :], mask=m_k[None, :],
                                   other=0.0).to(tl.float32)
                    b_kf = b_kj * tl.exp2(b_gr[None, :] - b_gj)                      # e^{G_r - G_j} <= 1
                    off_blk = r_i[:, None] * (HV * BT) + r_j[None, :]
                    b_dAq = tl.load(dAqk + off_blk, mask=m_i[:, None], other=0.0).to(tl.float32)
                    acc_q = dot_prec(b_dAq, b_kf, acc_q, NARROW, PREC)
                    b_dLb = tl.load(dL + off_blk, mask=m_i[:, None], other=0.0).to(tl.float32)
                    acc_a = dot_prec(b_dLb, b_kf, acc_a, NARROW, PREC)
                b_er = exp2_where(m_ik, b_g - b_gr[None, :])                # e^{G_i - G_r} <= 1
                b_Rq += acc_q * b_er
                b_Ra += acc_a * b_er

            # Column side, rows of later blocks: reference = last valid row e of block I.
            if I < NC - 1:
                e = tl.minimum(I * BC + BC, n_valid) - 1
                b_ge = tl.load(g + e * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
                acc_c = tl.zeros([BC, BK], dtype=tl.float32)
                for J in range(I + 1, NC):
                    r_j = J * BC + o_c
                    m_j = bounds_mask(r_j, n_valid, FULL_T)
                    m_jk = m_j[:, None] & m_k[None, :]
                    off_qkj = r_j[:, None] * (H * K) + o_k[None, :]
                    off_kj = r_j[:, None] * (HV * K) + o_k[None, :]
                    b_gj = tl.load(g + off_kj, mask=m_jk, other=0.0).to(tl.float32)
                    b_f = exp2_where(m_jk, b_gj - b_ge[None, :])           # e^{G_j - G_e} <= 1
                    # dM[rows of J, columns of I], read transposed: [BC (cols of I), BC (rows of J)]
                    off_t = r_j[None, :] * (HV * BT) + r_i[:, None]
                    b_qj = tl.load(q + off_qkj, mask=m_jk, other=0.0).to(tl.float32)
                    b_dAqT = tl.load(dAqk + off_t, mask=m_j[None, :], other=0.0).to(tl.float32)
                    acc_c = dot_prec(b_dAqT, b_qj * b_f, acc_c, NARROW, PREC)
                    b_kj = tl.load(k + off_qkj, mask=m_jk, other=0.0).to(tl.float32)
                    if VEC:
                        b_bj = tl.load(beta + off_kj, mask=m_jk, other=0.0).to(tl.float32)
                    else:
                        b_bj = tl.load(beta + r_j * HV, mask=m_j, other=0.0).to(tl.float32)[:, None]
                    b_dLT = tl.load(dL + off_t, mask=m_j[None, :], other=0.0).to(tl.float32)
                    acc_c = dot_prec(b_dLT, b_bj * b_kj * b_f, acc_c, NARROW, PREC)
                b_Rc += acc_c * exp2_where(m_ik, b_ge[None, :] - b_g)      # e^{G_e - G_i} <= 1

            # Diagonal block (causal inside): midpoint reference when the block's
            # gate spread allows, else the exact elementwise path.
            off_qk = r_i[:, None] * (H * K) + o_k[None, :]
            b_q = tl.load(q + off_qk, mask=m_ik, other=0.0).to(tl.float32)
            b_k = tl.load(k + off_qk, mask=m_ik, other=0.0).to(tl.float32)
            if VEC:
                b_b = tl.load(beta + off_k, mask=m_ik, other=0.0).to(tl.float32)
            else:
                b_b = tl.load(beta + r_i * HV, mask=m_i, other=0.0).to(tl.float32)[:, None]
            off_d = r_i[:, None] * (HV * BT) + r_i[None, :]
            m_ii = m_i[:, None] & m_i[None, :]
            b_dAqd = tl.load(dAqk + off_d, mask=m_i[:, None], other=0.0).to(tl.float32)
            # Aqk's diagonal (decay 1) is added apart from its strictly lower part, below.
            b_dAqd = tl.where((o_c[:, None] > o_c[None, :]) & m_ii, b_dAqd, 0.0)
            b_dLd = tl.load(dL + off_d, mask=m_i[:, None], other=0.0).to(tl.float32)
            b_dLd = tl.where((o_c[:, None] > o_c[None, :]) & m_ii, b_dLd, 0.0)
            g_hi = tl.max(tl.where(m_ik, b_g, float("-inf")), axis=0)
            g_lo = tl.min(tl.where(m_ik, b_g, float("inf")), axis=0)
            span = tl.max(tl.where(m_k, g_hi - g_lo, 0.0), axis=0)
            if span <= span_limit:
                mid = tl.where(m_k, 0.5 * (g_hi + g_lo), 0.0)
                b_ep = exp2_where(m_ik, b_g - mid[None, :])    # in [2^{-s/2}, 2^{s/2}]
                b_en = exp2_where(m_ik, mid[None, :] - b_g)
                b_kn = b_k * b_en
                b_Rq += tl.dot(b_dAqd, b_kn, input_precision=DPREC) * b_ep
                b_Ra += tl.dot(b_dLd, b_kn, input_precision=DPREC) * b_ep
                b_Rc += (tl.dot(tl.trans(b_dLd), b_b * b_k * b_ep, input_precision=DPREC)
                         + tl.dot(tl.trans(b_dAqd), b_q * b_ep, input_precision=DPREC)) * b_en
            else:
                for t in range(0, tl.minimum(BC, n_valid - I * BC)):
                    r_t = I * BC + t
                    b_kt = tl.load(k + r_t * (H * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
                    b_qt = tl.load(q + r_t * (H * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
                    b_gt = tl.load(g + r_t * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
                    if VEC:
                        b_bt = tl.load(beta + r_t * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
                    else:
                        b_bt = tl.load(beta + r_t * HV).to(tl.float32)
                    col_q = tl.load(dAqk + r_i * (HV * BT) + r_t, mask=m_i, other=0.0).to(tl.float32)
                    col_l = tl.load(dL + r_i * (HV * BT) + r_t, mask=m_i, other=0.0).to(tl.float32)
                    row_q = tl.load(dAqk + r_t * (HV * BT) + r_i).to(tl.float32)
                    row_l = tl.load(dL + r_t * (HV * BT) + r_i).to(tl.float32)
                    # rows i > t: e^{G_i - G_t} <= 1
                    m_lo = m_i & (o_c > t)
                    b_x = exp2_where(m_lo[:, None] & m_k[None, :], b_g - b_gt[None, :])
                    b_Rq += tl.where(m_lo, col_q, 0.0)[:, None] * b_kt[None, :] * b_x
                    b_Ra += tl.where(m_lo, col_l, 0.0)[:, None] * b_kt[None, :] * b_x
                    # columns j < t: e^{G_t - G_j} <= 1
                    m_up = m_i & (o_c < t)
                    b_y = exp2_where(m_up[:, None] & m_k[None, :], b_gt[None, :] - b_g)
                    b_Rc += (tl.where(m_up, row_l, 0.0)[:, None] * (b_bt * b_kt)[None, :]
                             + tl.where(m_up, row_q, 0.0)[:, None] * b_qt[None, :]) * b_y

            # Assemble: the inter-chunk parts from the WY kernel plus the Gram terms. The Gram terms'
            # gate share leaves Aqk's diagonal out (it carries no gate: under strong decay it would be
            # a large term entering at its row and leaving at its column, and leave only rounding);
            # the WY kernel's share arrives already summed over the chunk.
            b_dd = tl.load(dAqk + r_i * (HV * BT) + r_i, mask=m_i, other=0.0).to(tl.float32)
            b_dG = tl.where(m_ik, b_b * b_k * b_Ra + b_q * b_Rq - b_k * b_Rc, 0.0)
            b_dq = tl.load(dq + off_k, mask=m_ik, other=0.0) + b_Rq + b_dd[:, None] * b_k
            tl.store(dq_o + off_k, b_dq.to(dq_o.dtype.element_ty), mask=m_ik)
            b_dk = tl.load(dk + off_k, mask=m_ik, other=0.0) + b_b * b_Ra + b_Rc + b_dd[:, None] * b_q
            tl.store(dk_o + off_k, b_dk.to(dk_o.dtype.element_ty), mask=m_ik)
            b_dg = tl.cumsum(b_dG, axis=0, reverse=True) + carry[None, :]
            b_dg += tl.load(dG + off_k, mask=m_ik, other=0.0)
            carry += tl.sum(b_dG, axis=0)
            tl.store(dg_o + off_k, b_dg.to(dg_o.dtype.element_ty), mask=m_ik)
            if VEC:
                b_db = tl.load(dbp + off_k, mask=m_ik, other=0.0) + b_k * b_Ra
                tl.store(db_o + off_k, b_db.to(db_o.dtype.element_ty), mask=m_ik)
            else:
                # this block's share; the first block also folds in stage 1's slots.
                # Slot i_k of db_o ([.., NKI]; with one block that is the final db).
                b_db = tl.sum(b_k * b_Ra, axis=1)
                if i_k == 0:
                    for s in tl.static_range(NDB):
                        b_db += tl.load(dbp + r_i * (HV * NDB) + s, mask=m_i, other=0.0)
                tl.store(db_o + r_i * (HV * NKI) + i_k, b_db.to(db_o.dtype.element_ty), mask=m_i)


def rewy_kda_bwd_intra(q, k, g, beta, dAqk, dL, dq, dk, dG, db_part, cu_seqlens=None, chunk_indices=None,
                       inplace: bool = True, span_limit: float = common.SPAN_LIMIT, block_k: int | None = None,
                       dqk_dtype: torch.dtype | None = None, db_dtype: torch.dtype | None = None):
    """Stage 2 of the KDA / GDN2 local backward (see the module docstring): adds the Matrix Intra terms to the
    partials of stage 1 and returns the final (dq, dk, dg, db), dq and dk per
    value head. dg is with respect to the natural-log per-token gate (the
    reverse cumulative sum is done here). ``inplace`` writes dq, dk, dg over
    the partial buffers (and GDN2's db over its partials). The grid splits K into
    blocks of ``block_k`` (default ``common.INTRA_BLOCK_K``); with several blocks,
    KDA's per-block db shares are summed here. ``dqk_dtype`` / ``db_dtype``
    write the final dq, dk / GDN2's db in that dtype straight from the kernel
    (new buffers), which saves the caller a full conversion pass over them."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    vec = beta.dim() == 4
    BT = dAqk.shape[-1]
    BK = block_k or min(common.INTRA_BLOCK_K, max(16, triton.next_power_of_2(K)))
    NKI = triton.cdiv(K, BK)
    NDB = 1 if vec else db_part.shape[-1]
    NT, chunk_indices = chunk_table(T, cu_seqlens, CHUNK, chunk_indices)
    dev = q.device
    if inplace:
        dq_o, dk_o, dg_o = dq, dk, dG
    else:
        dq_o, dk_o, dg_o = (common.alloc((B, T, HV, K), dev) for _ in range(3))
    if vec:
        db_o = db_part if inplace else common.alloc((B, T, HV, K), dev)
    else:
        db_o = common.alloc((B, T, HV) if NKI == 1 else (B, T, HV, NKI), dev)
    if dqk_dtype is not None:
        dq_o, dk_o = (common.alloc((B, T, HV, K), dev, dqk_dtype) for _ in range(2))
    if vec and db_dtype is not None:
        db_o = common.alloc((B, T, HV, K), dev, db_dtype)
    # one autotune key for every launch of the call (SIZE from all its chunks)
    for chunks, order, full in chunk_launches(T, cu_seqlens, CHUNK):
        rewy_kda_bwd_intra_kernel[(chunks * NKI, B * HV)](
            q, k, g, beta, dAqk, dL, dq, dk, dG, db_part,
            dq_o, dk_o, dg_o, db_o,
            cu_seqlens, chunk_indices, order, T, size_class(NT * B * HV), float(span_limit),
            H=H, HV=HV, K=K, BT=BT, BC=SUB_BLOCK, BK=BK, NC=BT // SUB_BLOCK, NDB=NDB, NKI=NKI,
            VEC=vec, IS_VARLEN=cu_seqlens is not None, PREC=common.INTRA_PRECISION,
            DPREC=common.DIAG_PRECISION, FULL_T=full,
        )
    if not vec and NKI > 1:
        db_o = db_o.sum(-1)
    return dq_o, dk_o, dg_o, db_o
