"""Triton kernels: the local ReWY backward of KDA and GDN2 (vector gates).

Two kernels replace FLA 0.6.0's ``chunk_kda_bwd_kernel_wy_dqkg_fused`` and
``chunk_kda_bwd_kernel_intra`` (and their GDN2 twins). They take what FLA's
sequential stages produce: the states ``h`` entering each chunk, the
gradients ``dh`` of the states leaving it, ``v_new`` = Vn and its full
gradient ``dv2`` = dVn (``chunk_gated_delta_rule_bwd_dhu``), and
``dAqk`` = scale * causal(dO Vn^T) (``chunk_kda_bwd_dAv``).

Symbols (per chunk of BT = 64 tokens, design.md section 3): G the
chunk-local cumulative log-gates (FLA keeps them in log2 units, so e^G is
``exp2(g)``), a = b*k the erase-weighted keys, X = a e^G, Y = w*v, the
strictly lower gated key Gram L, A = (I + L)^{-1} (FLA's ``Akk``),
W = A X, U = A Y, Vn = U - W h.

1. ``rewy_kda_bwd_wy_kernel``, grid (chunks x (NK + 1), batch x value heads;
   a chunk's programs adjacent). Programs 0..NK-1 each own a block of BK key
   channels: over the value axis they form dW = -dVn h^T, d(q e^G) = dO h^T,
   d(k e^{G_C-G}) = Vn dh^T and the decay term sum_v h*dh, then Residual
   WY's dX = A^T dW, and write the inter-chunk parts of dq, dk, the gate
   gradient (before its cumulative sum) and the erase-gate gradient.
   Program NK owns the value side:
   dY = A^T dVn (giving dv and the write-gate gradient) and
       dL = -dY Vn^T.
   That last line is Residual WY collapsed one step further: Residual WY
   gives dL = -(dX W^T + dY U^T); with dW = -dVn h^T, dX = -dY h^T, so
   dX W^T + dY U^T = dY (U - W h)^T = dY Vn^T. No contraction over K is
   needed for dL, and W and U are never read. Three products in all:
   dY, dL and dX.
   KDA's erase gate is a scalar per token, so its gradient is a sum over K:
   each K block writes its partial into its own slot of a [.., NK + 1]
   buffer (slot NK from the value side); nothing is reduced with atomics.
2. ``rewy_kda_bwd_intra_kernel``, grid (chunks x K blocks, batch x value
   heads): the gated-Gram backward of L (rows a = b*k, columns k) and of
   Aqk (rows q, columns k) by Matrix Intra, over the chunk's four 16-row
   sub-blocks (last first), plus the assembly of the final dq, dk, db and the
   gate gradient with its reverse cumulative sum inside the chunk, carried
   across sub-blocks (Gram Elimination: dG = a*Ra + q*Rq - k*Rc, from the
   row/column gradients the key gradient needs anyway; L is never rebuilt).
   It updates the WY kernel's partials in place. KDA's db: the first K
   block folds in stage 1's slots; with one K block that is the final db,
   with several each block writes its share to its own slot of a new
   [.., NKI] buffer and the caller sums them (one small reduction).
   The loop over sub-blocks is latency-bound, and its products are small
   ([16, 16] x [16, BK]), so each program runs two warps with the J loops
   software-pipelined (num_stages 3): 1.13 ms at (2, 8192, 16) on the
   H200, against 1.51 ms with four or eight warps and 32-channel blocks.
   A whole-chunk variant (16 masked [64, 64] x [64, BK] products instead
   of 40 [16, 16] ones, q/k/gates loaded once) was built and measured
   too: 1.83 / 2.75 ms at block width 32 / 64, slower, and was removed.

Launch configs come from sweeps on the H200 (``benchmarks/kernel_configs.py``,
which also reruns each config to catch nondeterministic code): fewer warps
than the tile sizes suggest win for both kernels, because both are
latency-bound. Configs whose compiled code gave wrong or run-to-run different
outputs under triton 3.6.0 (the WY kernel with 4 warps and software
pipelining, or with a ``maxnreg`` cap) are kept out of the autotune lists.

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

Layout: FLA's [B, T, heads, D] token layout, ``cu_seqlens`` varlen through
FLA's ``chunk_indices``, states [B, NT, HV, K, V] (or [.., V, K] with
``state_v_first``). Plain pointer arithmetic with masks throughout (no block
pointers), so the same code runs under Triton's CPU interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_blocks import key_block, size_class
from .triton_masks import bounds_mask

BT_CHUNK = 64
BC_SUB = 16
# Largest per-channel spread (log2 units) of a 16-row block's cumulative gate
# for which the diagonal block is done with tensor cores; see module docstring.
SPAN_LIMIT = 120.0
# Input precision of the off-diagonal Matrix Intra contractions on the GPU ("tf32", "tf32x3" or "ieee"
# on fp32 operands; "bf16" rounds both operands to the inputs' dtype first, half the MMA steps of tf32);
# FLA uses tf32 for the same off-diagonal products.
INTRA_PRECISION = os.environ.get("REWY_KDA_INTRA_PRECISION", "tf32")
# The diagonal 16-row blocks carry the largest terms (e^{G_i - G_j} near 1),
# which FLA computes elementwise in fp32, and the gate gradient sums them with
# cancellation: with tf32 here KDA's dg error on the H200 was 1.5x FLA's
# (3.7e-3 vs 2.5e-3 at (2, 4096, 16)); tf32x3 matches FLA's error. It cost 2 %
# in benchmarks/kda_precision.py, but 0-19 % of the backward per shape in the
# six-shape suite (docs/performance.md), which is why the diagonal is in the plan.
DIAG_PRECISION = os.environ.get("REWY_KDA_DIAG_PRECISION", "tf32x3")
# Operands of the two Residual WY products that take an fp32 partial (A^T dW
# and dY Vn^T): "bf16" rounds the partial to bf16 like FLA's kernel does;
# "tf32" / "tf32x3" / "ieee" keep it in fp32 with that input precision.
WY_PRECISION = os.environ.get("REWY_KDA_WY_PRECISION", "bf16")
# Key channels per stage-2 program. With two warps per program 64 is fastest; 32 won only while
# the kernel ran four or eight warps on its small tiles (docs/performance.md).
INTRA_BLOCK_K = int(os.environ.get("REWY_KDA_INTRA_BLOCK_K", "64"))


def _narrow(dtype: torch.dtype) -> torch.dtype | None:
    """A final output dtype other than the fp32 of the partials (which are then updated in place)."""
    return None if dtype == torch.float32 else dtype


def _alloc(shape, device, dtype=torch.float32):
    """Output allocation (tests patch this to NaN-filled buffers)."""
    return torch.empty(shape, device=device, dtype=dtype)


def _wy_config_ok(BK: int, config: triton.Config) -> bool:
    """Whether the Residual WY kernel may run with ``config`` and key blocks of BK channels. With one
    warpgroup (4 warps), value tiles of 64 and key blocks narrower than 64 (BK 16 or 32), triton 3.6.0
    miscompiles the key side on the H200: dk, the gate and the erase-gate partials come out wrong
    (20 % off at BK 32), or the launch faults with an illegal memory access (BK 16; BK 32 at
    (2, 8192, 16)). The kernel's indexing is not at fault: the interpreter gives the right outputs,
    compute-sanitizer finds no out-of-bounds access where the values are wrong, and the same code is
    right with 8 warps, or value tiles of 128 or 32, at BK 32, and with 4 warps at BK 64.
    The autotuner prunes such configs; ``rewy_kda_bwd_wy`` refuses a list that holds nothing else."""
    return not (config.num_warps == 4 and config.kwargs.get("BV") == 64 and BK < 64)


@triton.jit
def _exp2_where(m, x):
    """exp2(x) where m, else 0, with the exponent masked first (no inf in dead lanes)."""
    return tl.exp2(tl.where(m, x, float("-inf")))


@triton.jit
def _dot_prec(a, b, acc, NARROW: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b for fp32 operands: rounded to NARROW (the inputs' dtype) when PREC is "bf16", else
    multiplied at input precision PREC."""
    if PREC == "bf16":
        return tl.dot(a.to(NARROW), b.to(NARROW), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.autotune(
    # From benchmarks/kernel_configs.py on the H200 at (2, 8192, 16), K = V = 128: 4 warps without
    # software pipelining is fastest (KDA 0.69 ms, GDN2 0.79 ms, against 0.85 / 0.98 ms with 8 warps
    # and 3 stages). 4 warps *with* pipelining (2 or 3 stages) was faster still but gave different
    # outputs from run to run (triton 3.6.0), and 4 warps with a maxnreg cap gave wrong ones: neither
    # may be listed here. Every config listed was rerun on the same inputs and matched bit for bit.
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
             for bv, nw, ns in ((128, 4, 1), (64, 4, 1), (64, 8, 3))],
    key=["SIZE", "H", "HV", "K", "V", "BK", "VEC", "STATE_V_FIRST"],
    # (64, 4 warps) is miscompiled with key blocks narrower than 64: see _wy_config_ok
    prune_configs_by={"early_config_prune": lambda configs, nargs, **kw: [
        c for c in configs if _wy_config_ok(nargs["BK"] if "BK" in nargs else kw["BK"], c)]},
)
@triton.jit(do_not_specialize=["T", "SIZE"])
def rewy_kda_bwd_wy_kernel(
    q, k, v, v_new, g, beta, wg, A, h, dh, do, dv2,
    dq, dk, dv, dG, db, dw, dL,
    cu_seqlens, chunk_indices, scale, T, SIZE,
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
        b_e = _exp2_where(m_tk, b_g)                   # e^G
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
        b_dkc = b_dkc * _exp2_where(m_tk, b_gc[None, :] - b_g)      # d(k e^{G_C-G}) * e^{G_C-G}
        b_dk += b_dkc
        tl.store(dk + off_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        b_kdkc = b_k * b_dkc
        b_dGC = b_dgc * tl.exp2(b_gc) + tl.sum(b_kdkc, axis=0)
        b_dG += tl.where((o_r == last)[:, None], b_dGC[None, :], 0.0) - b_kdkc
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


@triton.autotune(
    # Its tiles are [16, BK]: two warps cover them, and num_stages > 1 lets Triton prefetch the next
    # sub-block of the J loops while multiplying this one. On the H200 at (2, 8192, 16), block width 64:
    # 1.13 ms with (2 warps, 3 stages) against 1.46 (4, 3), 1.72 (4, 1) and 2.90 (8, 1)
    # (benchmarks/kernel_configs.py).
    configs=[triton.Config({}, num_warps=nw, num_stages=ns) for nw, ns in ((2, 3), (2, 2), (4, 3))],
    key=["SIZE", "H", "HV", "K", "BK", "VEC", "NDB", "NKI"],
    # the kernel updates its partial inputs in place: benchmarking configs must not accumulate
    restore_value=["dq", "dk", "dG", "dbp"],
)
@triton.jit(do_not_specialize=["T", "SIZE"])
def rewy_kda_bwd_intra_kernel(
    q, k, g, beta, dAqk, dL, dq, dk, dG, dbp,
    dq_o, dk_o, dg_o, db_o,
    cu_seqlens, chunk_indices, T, SIZE, span_limit,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, NC: tl.constexpr, NDB: tl.constexpr, NKI: tl.constexpr, VEC: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, DPREC: tl.constexpr, FULL: tl.constexpr,
):
    # the key blocks of one chunk are adjacent in launch order: they share its dAqk and dL tiles through L2
    i_t, i_k, i_bh = tl.program_id(0) // NKI, tl.program_id(0) % NKI, tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
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
    # FULL: every chunk has BT rows and BK divides K, so the bounds masks are constants (triton_masks.py)
    m_k = bounds_mask(o_k, K, FULL)
    carry = tl.zeros([BK], dtype=tl.float32)       # sum of the gate terms of later rows
    # Last sub-block first, so the reverse cumulative sum can carry across blocks.
    # A runtime loop (not unrolled): unrolling the four blocks and their inner
    # loops multiplies live registers.
    for ii in range(0, NC):
        I = NC - 1 - ii
        if I * BC < n_valid:
            r_i = I * BC + o_c                      # rows of block I within the chunk
            m_i = bounds_mask(r_i, n_valid, FULL)
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
                    acc_q = _dot_prec(b_dAq, b_kf, acc_q, NARROW, PREC)
                    b_dLb = tl.load(dL + off_blk, mask=m_i[:, None], other=0.0).to(tl.float32)
                    acc_a = _dot_prec(b_dLb, b_kf, acc_a, NARROW, PREC)
                b_er = _exp2_where(m_ik, b_g - b_gr[None, :])                # e^{G_i - G_r} <= 1
                b_Rq += acc_q * b_er
                b_Ra += acc_a * b_er

            # Column side, rows of later blocks: reference = last valid row e of block I.
            if I < NC - 1:
                e = tl.minimum(I * BC + BC, n_valid) - 1
                b_ge = tl.load(g + e * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
                acc_c = tl.zeros([BC, BK], dtype=tl.float32)
                for J in range(I + 1, NC):
                    r_j = J * BC + o_c
                    m_j = bounds_mask(r_j, n_valid, FULL)
                    m_jk = m_j[:, None] & m_k[None, :]
                    off_qkj = r_j[:, None] * (H * K) + o_k[None, :]
                    off_kj = r_j[:, None] * (HV * K) + o_k[None, :]
                    b_gj = tl.load(g + off_kj, mask=m_jk, other=0.0).to(tl.float32)
                    b_f = _exp2_where(m_jk, b_gj - b_ge[None, :])           # e^{G_j - G_e} <= 1
                    # dM[rows of J, columns of I], read transposed: [BC (cols of I), BC (rows of J)]
                    off_t = r_j[None, :] * (HV * BT) + r_i[:, None]
                    b_qj = tl.load(q + off_qkj, mask=m_jk, other=0.0).to(tl.float32)
                    b_dAqT = tl.load(dAqk + off_t, mask=m_j[None, :], other=0.0).to(tl.float32)
                    acc_c = _dot_prec(b_dAqT, b_qj * b_f, acc_c, NARROW, PREC)
                    b_kj = tl.load(k + off_qkj, mask=m_jk, other=0.0).to(tl.float32)
                    if VEC:
                        b_bj = tl.load(beta + off_kj, mask=m_jk, other=0.0).to(tl.float32)
                    else:
                        b_bj = tl.load(beta + r_j * HV, mask=m_j, other=0.0).to(tl.float32)[:, None]
                    b_dLT = tl.load(dL + off_t, mask=m_j[None, :], other=0.0).to(tl.float32)
                    acc_c = _dot_prec(b_dLT, b_bj * b_kj * b_f, acc_c, NARROW, PREC)
                b_Rc += acc_c * _exp2_where(m_ik, b_ge[None, :] - b_g)      # e^{G_e - G_i} <= 1

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
            b_dAqd = tl.where((o_c[:, None] >= o_c[None, :]) & m_ii, b_dAqd, 0.0)
            b_dLd = tl.load(dL + off_d, mask=m_i[:, None], other=0.0).to(tl.float32)
            b_dLd = tl.where((o_c[:, None] > o_c[None, :]) & m_ii, b_dLd, 0.0)
            g_hi = tl.max(tl.where(m_ik, b_g, float("-inf")), axis=0)
            g_lo = tl.min(tl.where(m_ik, b_g, float("inf")), axis=0)
            span = tl.max(tl.where(m_k, g_hi - g_lo, 0.0), axis=0)
            if span <= span_limit:
                mid = tl.where(m_k, 0.5 * (g_hi + g_lo), 0.0)
                b_ep = _exp2_where(m_ik, b_g - mid[None, :])    # in [2^{-s/2}, 2^{s/2}]
                b_en = _exp2_where(m_ik, mid[None, :] - b_g)
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
                    # rows i >= t: e^{G_i - G_t} <= 1
                    m_lo = m_i & (o_c >= t)
                    b_x = _exp2_where(m_lo[:, None] & m_k[None, :], b_g - b_gt[None, :])
                    b_Rq += tl.where(m_lo, col_q, 0.0)[:, None] * b_kt[None, :] * b_x
                    b_Ra += tl.where(m_lo & (o_c > t), col_l, 0.0)[:, None] * b_kt[None, :] * b_x
                    # columns j <= t: e^{G_t - G_j} <= 1
                    m_up = m_i & (o_c <= t)
                    b_y = _exp2_where(m_up[:, None] & m_k[None, :], b_gt[None, :] - b_g)
                    b_Rc += (tl.where(m_up & (o_c < t), row_l, 0.0)[:, None] * (b_bt * b_kt)[None, :]
                             + tl.where(m_up, row_q, 0.0)[:, None] * b_qt[None, :]) * b_y

            # Assemble: the inter-chunk parts from the WY kernel plus the Gram terms.
            b_dq = tl.load(dq + off_k, mask=m_ik, other=0.0) + b_Rq
            tl.store(dq_o + off_k, b_dq.to(dq_o.dtype.element_ty), mask=m_ik)
            b_dk = tl.load(dk + off_k, mask=m_ik, other=0.0) + b_b * b_Ra + b_Rc
            tl.store(dk_o + off_k, b_dk.to(dk_o.dtype.element_ty), mask=m_ik)
            b_dG = tl.load(dG + off_k, mask=m_ik, other=0.0) + b_b * b_k * b_Ra + b_q * b_Rq - b_k * b_Rc
            b_dG = tl.where(m_ik, b_dG, 0.0)
            b_dg = tl.cumsum(b_dG, axis=0, reverse=True) + carry[None, :]
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


def _varlen(cu_seqlens, chunk_indices, T: int, B: int):
    if cu_seqlens is None:
        return triton.cdiv(T, BT_CHUNK), None
    if chunk_indices is None:
        from fla.ops.utils import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, BT_CHUNK)
    return len(chunk_indices), chunk_indices


def rewy_kda_bwd_wy(q, k, v, v_new, g, beta, A, h, dh, do, dv2, scale: float, w_gate=None,
                    state_v_first: bool = False, cu_seqlens=None, chunk_indices=None, block_k: int | None = None):
    """Stage 1 (see module docstring). Shapes: q, k [B, T, H, K]; v, v_new, do,
    dv2 [B, T, HV, V]; g (log2 chunk cumsum) [B, T, HV, K]; beta [B, T, HV]
    (KDA) or the erase gate b [B, T, HV, K] with ``w_gate`` [B, T, HV, V]
    (GDN2); A [B, T, HV, 64]; h, dh [B, NT, HV, K, V] (or [.., V, K]).

    Returns the partials (dq, dk, dG) [B, T, HV, K] fp32, the final dv and dw
    (None for KDA) in v's and w_gate's dtype,
    the erase-gate partials (KDA: [B, T, HV, NK + 1], slot NK from the value
    side; GDN2: [B, T, HV, K]) and dL [B, T, HV, 64] fp32 (strictly lower).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = A.shape[-1]
    if BT != BT_CHUNK:
        raise ValueError(f"chunk size {BT} != {BT_CHUNK}")
    vec = w_gate is not None
    BK = block_k or key_block(K)
    if not any(_wy_config_ok(BK, c) for c in rewy_kda_bwd_wy_kernel.configs):
        raise ValueError(f"Residual WY with {BK}-channel key blocks: 4 warps with BV = 64 need block_k >= 64 "
                         "(triton 3.6 miscompiles narrower key blocks there); use block_k=64, BV = 128 or 8 warps")
    NK = triton.cdiv(K, BK)
    NT, chunk_indices = _varlen(cu_seqlens, chunk_indices, T, B)
    dev = q.device
    dq, dk, dG = (_alloc((B, T, HV, K), dev) for _ in range(3))
    dv = _alloc((B, T, HV, V), dev, v.dtype)                        # final: written in the input dtype
    dw = _alloc((B, T, HV, V), dev, w_gate.dtype) if vec else None
    db = _alloc((B, T, HV, K), dev) if vec else _alloc((B, T, HV, NK + 1), dev)
    dL = _alloc((B, T, HV, BT), dev)
    grid = (NT * (NK + 1), B * HV)
    rewy_kda_bwd_wy_kernel[grid](
        q, k, v, v_new, g, beta, w_gate if vec else beta, A, h, dh, do, dv2,
        dq, dk, dv, dG, db, dw if vec else dv, dL,
        cu_seqlens, chunk_indices, scale, T, size_class(NT * B * HV),
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, NK=NK, VEC=vec, STATE_V_FIRST=state_v_first,
        IS_VARLEN=cu_seqlens is not None, WPREC=WY_PRECISION, FULL_T=cu_seqlens is None and T % BT == 0,
    )
    return dq, dk, dG, dv, dw, db, dL


def rewy_kda_bwd_intra(q, k, g, beta, dAqk, dL, dq, dk, dG, db_part, cu_seqlens=None, chunk_indices=None,
                       inplace: bool = True, span_limit: float = SPAN_LIMIT, block_k: int | None = None,
                       dqk_dtype: torch.dtype | None = None, db_dtype: torch.dtype | None = None):
    """Stage 2 (see module docstring): adds the Matrix Intra terms to the
    partials of stage 1 and returns the final (dq, dk, dg, db), dq and dk per
    value head. dg is with respect to the natural-log per-token gate (the
    reverse cumulative sum is done here). ``inplace`` writes dq, dk, dg over
    the partial buffers (and GDN2's db over its partials). The grid splits K into
    blocks of ``block_k`` (default ``INTRA_BLOCK_K``); with several blocks,
    KDA's per-block db shares are summed here. ``dqk_dtype`` / ``db_dtype``
    write the final dq, dk / GDN2's db in that dtype straight from the kernel
    (new buffers), which saves the caller a full conversion pass over them."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    vec = beta.dim() == 4
    BT = dAqk.shape[-1]
    BK = block_k or min(INTRA_BLOCK_K, max(16, triton.next_power_of_2(K)))
    NKI = triton.cdiv(K, BK)
    NDB = 1 if vec else db_part.shape[-1]
    NT, chunk_indices = _varlen(cu_seqlens, chunk_indices, T, B)
    dev = q.device
    if inplace:
        dq_o, dk_o, dg_o = dq, dk, dG
    else:
        dq_o, dk_o, dg_o = (_alloc((B, T, HV, K), dev) for _ in range(3))
    if vec:
        db_o = db_part if inplace else _alloc((B, T, HV, K), dev)
    else:
        db_o = _alloc((B, T, HV) if NKI == 1 else (B, T, HV, NKI), dev)
    if dqk_dtype is not None:
        dq_o, dk_o = (_alloc((B, T, HV, K), dev, dqk_dtype) for _ in range(2))
    if vec and db_dtype is not None:
        db_o = _alloc((B, T, HV, K), dev, db_dtype)
    rewy_kda_bwd_intra_kernel[(NT * NKI, B * HV)](
        q, k, g, beta, dAqk, dL, dq, dk, dG, db_part,
        dq_o, dk_o, dg_o, db_o,
        cu_seqlens, chunk_indices, T, size_class(NT * B * HV), float(span_limit),
        H=H, HV=HV, K=K, BT=BT, BC=BC_SUB, BK=BK, NC=BT // BC_SUB, NDB=NDB, NKI=NKI,
        VEC=vec, IS_VARLEN=cu_seqlens is not None, PREC=INTRA_PRECISION,
        DPREC=DIAG_PRECISION, FULL=cu_seqlens is None and T % BT == 0 and K % BK == 0,
    )
    if not vec and NKI > 1:
        db_o = db_o.sum(-1)
    return dq_o, dk_o, dg_o, db_o


def rewy_kda_bwd(q, k, v, v_new, g, beta, A, h, dh, do, dv2, dAqk, scale: float, w_gate=None,
                 state_v_first: bool = False, cu_seqlens=None, chunk_indices=None, block_k: int | None = None,
                 final_dtypes: bool = False, intra_block_k: int | None = None):
    """Both stages. Returns (dq, dk, dv, dg, db, dw): dq, dk, dg, db in fp32, dq
    and dk per value head ([B, T, HV, K]; the caller sums GVA groups); dv, dw
    in the dtypes of v and w_gate (dw None for KDA). ``final_dtypes`` (only
    without GVA, where dq and dk per value head are already final): dq, dk in
    q's dtype and GDN2's db in b's, written so by the kernel. ``block_k`` /
    ``intra_block_k``: key channels per program of stage 1 / stage 2."""
    if final_dtypes and q.shape[2] != v.shape[2]:
        raise ValueError("final_dtypes needs as many q/k heads as v heads: under GVA dq and dk are summed later")
    args = [t.contiguous() for t in (q, k, v, v_new, g, beta, A, h, dh, do, dv2)]
    q, k, v, v_new, g, beta, A, h, dh, do, dv2 = args
    w_gate = None if w_gate is None else w_gate.contiguous()
    if cu_seqlens is not None and chunk_indices is None:
        _, chunk_indices = _varlen(cu_seqlens, None, q.shape[1], q.shape[0])
    dq, dk, dG, dv, dw, db, dL = rewy_kda_bwd_wy(q, k, v, v_new, g, beta, A, h, dh, do, dv2, scale, w_gate,
                                                  state_v_first, cu_seqlens, chunk_indices, block_k)
    dq, dk, dg, db = rewy_kda_bwd_intra(q, k, g, beta, dAqk.contiguous(), dL, dq, dk, dG, db, cu_seqlens,
                                        chunk_indices, block_k=intra_block_k,
                                        dqk_dtype=_narrow(q.dtype) if final_dtypes else None,
                                        db_dtype=_narrow(beta.dtype) if final_dtypes else None)
    return dq, dk, dv, dg, db, dw
