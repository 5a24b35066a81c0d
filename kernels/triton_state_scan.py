"""Sequence-parallel state recurrences of GDN / DeltaNet (Triton).

FLA's ``chunk_gated_delta_rule_fwd_h`` and ``..._bwd_dhu`` walk the chunks of a
sequence one after another, one program per (value block, batch x head).
With few batch x heads and long sequences (B x H = 16 or 32 at T = 16k-32k)
most of the H200's 132 SMs sit idle. Both recurrences are affine in the state,
so they can be split along the sequence into NS segments of L chunks:

    forward   h_{c+1} = M_c h_c + k_g^T u_c,  M_c = e^{g_C} I - k_g^T w_c
    backward  D_{c-1} = M_c^T D_c + scale q_g^T do_c - w_c^T dv_c

(k_g = k e^{g_C - g}, q_g = q e^{g}, D_c the gradient of the state leaving chunk
c, dv_c FLA's local dv). Three phases, each parallel over segments except the
short middle one:

1. ``segment``: every segment runs its chunks from the augmented start
   [I | 0] with inputs [0 | u]: the I columns become the segment's composed
   transition P (K x K), the others its zero-start state Z (K x V).
2. ``scan``: the true state at every segment boundary, S_{s+1} = P_s S_s + Z_s,
   sequential over the NS segments only.
3. ``segment`` again, started from the true boundary states, writing what
   FLA's kernels write: h (or dh) per chunk and v_new (or dv2) per token.

Per-key gates (KDA, GDN2) take the same path with ``gk``: the state decays
row by row and k, q arrive pre-gated, as FLA passes them.

Work is about three times the sequential recurrence (phase 1 carries K extra
columns), spread over NS times more programs. The caller uses it only when
the sequential form would leave the GPU mostly idle (see ``segments_for``).
Gates are FLA's: chunk-local cumulative sums in log2 units.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .state_launch import sm_count
from .triton_blocks import key_block
from .triton_masks import bounds_mask


# 4 warps only: with 2 the two fp32 state halves spill (0.6-12 KB per thread, sm_90 offline,
# benchmarks/kernel_registers.py --kernel state-segment).
_CONFIGS = [triton.Config({"BV": bv}, num_warps=4, num_stages=ns) for bv in (32, 64) for ns in (2, 3)]


@triton.jit
def _walk(S1, S2, k, w, u, g, q, do, h_out, vn_out, scale, i_b, i_h, i_hv, c0, n, cols, T, NT,
          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          BT: tl.constexpr, BKH: tl.constexpr, BV: tl.constexpr, TWO: tl.constexpr,
          USE_G: tl.constexpr, USE_GK: tl.constexpr, REVERSE: tl.constexpr,
          HAS_INPUT: tl.constexpr, STORE: tl.constexpr, FULL_T: tl.constexpr):
    """Walk chunks c0 .. c0 + n - 1 (backwards when REVERSE) for one block of BV state
    columns, the state held as two row halves S1 = rows [0, BKH), S2 = rows [BKH, 2 BKH).

    HAS_INPUT: the columns are value columns and see u (forward) / dv, q, do
    (backward); otherwise they are columns of the segment transition and see
    only the homogeneous part. STORE: write the per-chunk state (before the
    chunk, as FLA does) and v_new / dv2."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BKH)
    m_k1 = bounds_mask(o_k, K, K % BKH == 0)
    m_k2 = bounds_mask(BKH + o_k, K, K % BKH == 0)
    m_v = bounds_mask(cols, V, V % BV == 0)
    for j in range(0, n):
        if REVERSE:
            i_t = c0 + n - 1 - j
        else:
            i_t = c0 + j
        rows = i_t * BT + o_t
        m_t = bounds_mask(rows, T, FULL_T)
        tok = (i_b * T + rows).to(tl.int64)
        if STORE:
            p_s = h_out + (((i_b * NT + i_t) * HV + i_hv) * K * V).to(tl.int64) + o_k[:, None] * V + cols[None, :]
            tl.store(p_s, S1.to(h_out.dtype.element_ty), mask=m_k1[:, None] & m_v[None, :])
            if TWO:
                tl.store(p_s + BKH * V, S2.to(h_out.dtype.element_ty), mask=m_k2[:, None] & m_v[None, :])
        p_k = k + (tok * H + i_h)[:, None] * K + o_k[None, :]
        p_w = w + (tok * HV + i_hv)[:, None] * K + o_k[None, :]
        b_k1 = tl.load(p_k, mask=m_t[:, None] & m_k1[None, :], other=0.0)
        b_w1 = tl.load(p_w, mask=m_t[:, None] & m_k1[None, :], other=0.0)
        if TWO:
            b_k2 = tl.load(p_k + BKH, mask=m_t[:, None] & m_k2[None, :], other=0.0)
            b_w2 = tl.load(p_w + BKH, mask=m_t[:, None] & m_k2[None, :], other=0.0)
        last = (i_b * T + tl.minimum(T, i_t * BT + BT) - 1).to(tl.int64)
        # Per-row state decay over the chunk (d1, d2) and per-token key decay to the chunk end.
        if USE_G:
            b_g = tl.load(g + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
            b_gl = tl.load(g + last * HV + i_hv).to(tl.float32)
            b_kdecay = tl.where(m_t, tl.exp2(b_gl - b_g), 0.0)
            d1 = tl.exp2(b_gl)
            d2 = d1
        elif USE_GK:
            d1 = tl.exp2(tl.load(g + (last * HV + i_hv) * K + o_k, mask=m_k1, other=0.0).to(tl.float32))[:, None]
            d2 = d1
            if TWO:
                d2 = tl.exp2(tl.load(g + (last * HV + i_hv) * K + BKH + o_k, mask=m_k2,
                                     other=0.0).to(tl.float32))[:, None]
        else:
            d1 = 1.0
            d2 = 1.0
        p_tv = (tok * HV + i_hv)[:, None] * V + cols[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        dt = b_k1.dtype
        if REVERSE:
            # dv2 = dv + k_g D;  D <- e^{g_C} D + scale q_g^T do - w^T dv2
            if USE_G:
                b_k1 = (b_k1 * b_kdecay[:, None]).to(dt)
                if TWO:
                    b_k2 = (b_k2 * b_kdecay[:, None]).to(dt)
            b_x = tl.dot(b_k1, S1.to(dt))
            if TWO:
                b_x = tl.dot(b_k2, S2.to(dt), b_x)
            if HAS_INPUT:
                b_x += tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
                if STORE:
                    tl.store(vn_out + p_tv, b_x.to(vn_out.dtype.element_ty), mask=m_tv)
            b_x = b_x.to(dt)
            S1 = S1 * d1 - tl.dot(tl.trans(b_w1), b_x)
            if TWO:
                S2 = S2 * d2 - tl.dot(tl.trans(b_w2), b_x)
            if HAS_INPUT:
                b_do = tl.load(do + p_tv, mask=m_tv, other=0.0).to(dt)
                p_q = q + (tok * H + i_h)[:, None] * K + o_k[None, :]
                b_q1 = tl.load(p_q, mask=m_t[:, None] & m_k1[None, :], other=0.0)
                if USE_G:
                    b_q1 = (b_q1 * tl.exp2(b_g)[:, None]).to(dt)
                S1 += scale * tl.dot(tl.trans(b_q1), b_do)
                if TWO:
                    b_q2 = tl.load(p_q + BKH, mask=m_t[:, None] & m_k2[None, :], other=0.0)
                    if USE_G:
                        b_q2 = (b_q2 * tl.exp2(b_g)[:, None]).to(dt)
                    S2 += scale * tl.dot(tl.trans(b_q2), b_do)
        else:
            # v_new = u - w h;  h <- e^{g_C} h + k^T (v_new e^{g_C - g})
            b_x = -tl.dot(b_w1, S1.to(dt))
            if TWO:
                b_x -= tl.dot(b_w2, S2.to(dt))
            if HAS_INPUT:
                b_x += tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
                if STORE:
                    tl.store(vn_out + p_tv, b_x.to(vn_out.dtype.element_ty), mask=m_tv)
            if USE_G:
                b_x = b_x * b_kdecay[:, None]
            b_x = b_x.to(dt)
            S1 = S1 * d1 + tl.dot(tl.trans(b_k1), b_x)
            if TWO:
                S2 = S2 * d2 + tl.dot(tl.trans(b_k2), b_x)
    return S1, S2


@triton.autotune(configs=_CONFIGS, key=["H", "HV", "K", "V", "USE_G", "USE_GK", "REVERSE", "FINAL"])
@triton.jit(do_not_specialize=["T", "NT", "L"])
def _segment_kernel(
    k, w, u, g, q, do, start, pz, h_out, vn_out,
    scale, T, NT, L,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKH: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_GK: tl.constexpr, REVERSE: tl.constexpr, FINAL: tl.constexpr,
    FULL_T: tl.constexpr,
):
    """One segment of the forward (REVERSE=False) or backward (REVERSE=True)
    recurrence for one block of BV state columns.

    First pass (FINAL=False): program blocks [0, cdiv(K, BV)) carry columns of
    the segment transition, started from the identity and fed no inputs;
    the others carry value columns started from zero. Both write their end
    state into pz [B, NS, HV, K, K + V] (transition P left, zero-start state Z
    right). Final pass (FINAL=True): value columns started from ``start``
    [B, NS, HV, K, V] (fp32), writing h_out / vn_out: the per-chunk states and
    the per-token v_new (forward) or dh and dv2 (backward).
    USE_GK (KDA, GDN2): g is the per-key log2 gate cumsum [B, T, HV, K] and, as
    in FLA, k and q arrive already gated; the state decays row by row."""
    i_c, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    NS = tl.num_programs(1)
    TWO: tl.constexpr = K > BKH
    NPB: tl.constexpr = (K + BV - 1) // BV         # transition column blocks in the first pass
    o_k = tl.arange(0, BKH)
    m_k1 = bounds_mask(o_k, K, K % BKH == 0)
    m_k2 = bounds_mask(BKH + o_k, K, K % BKH == 0)
    c0 = i_s * L
    n = tl.minimum(L, NT - c0)
    off_seg = ((i_b * NS + i_s) * HV + i_hv).to(tl.int64)
    if FINAL:
        cols = i_c * BV + tl.arange(0, BV)
        m_c = bounds_mask(cols, V, V % BV == 0)
        p_st = start + off_seg * K * V + o_k[:, None] * V + cols[None, :]
        S1 = tl.load(p_st, mask=m_k1[:, None] & m_c[None, :], other=0.0)
        S2 = tl.zeros([BKH, BV], dtype=tl.float32)
        if TWO:
            S2 = tl.load(p_st + BKH * V, mask=m_k2[:, None] & m_c[None, :], other=0.0)
        S1, S2 = _walk(S1, S2, k, w, u, g, q, do, h_out, vn_out, scale, i_b, i_h, i_hv, c0, n, cols, T, NT,
                       H, HV, K, V, BT, BKH, BV, TWO, USE_G, USE_GK, REVERSE, True, True, FULL_T)
    else:
        if i_c < NPB:
            pcols = i_c * BV + tl.arange(0, BV)
            S1 = tl.where(o_k[:, None] == pcols[None, :], 1.0, 0.0).to(tl.float32)
            S2 = tl.where(BKH + o_k[:, None] == pcols[None, :], 1.0, 0.0).to(tl.float32)
            S1, S2 = _walk(S1, S2, k, w, u, g, q, do, h_out, vn_out, scale, i_b, i_h, i_hv, c0, n, pcols, T, NT,
                           H, HV, K, V, BT, BKH, BV, TWO, USE_G, USE_GK, REVERSE, False, False, FULL_T)
            m_c = pcols < K
            ocols = pcols
        else:
            cols = (i_c - NPB) * BV + tl.arange(0, BV)
            S1 = tl.zeros([BKH, BV], dtype=tl.float32)
            S2 = tl.zeros([BKH, BV], dtype=tl.float32)
            S1, S2 = _walk(S1, S2, k, w, u, g, q, do, h_out, vn_out, scale, i_b, i_h, i_hv, c0, n, cols, T, NT,
                           H, HV, K, V, BT, BKH, BV, TWO, USE_G, USE_GK, REVERSE, True, False, FULL_T)
            m_c = cols < V
            ocols = K + cols
        p_pz = pz + off_seg * K * (K + V) + o_k[:, None] * (K + V) + ocols[None, :]
        tl.store(p_pz, S1, mask=m_k1[:, None] & m_c[None, :])
        if TWO:
            tl.store(p_pz + BKH * (K + V), S2, mask=m_k2[:, None] & m_c[None, :])


@triton.jit
def _scan_kernel(pz, s0, starts, s_final, NS, HV,
                 K: tl.constexpr, V: tl.constexpr, BKH: tl.constexpr, BV: tl.constexpr,
                 HAS_S0: tl.constexpr, REVERSE: tl.constexpr):
    """Boundary states: S <- P_s S + Z_s over the segments (in reverse for the
    backward), writing each segment's start state and the state after all.
    P is applied as four [BKH, BKH] blocks, so no program holds a K x K tile."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    TWO: tl.constexpr = K > BKH
    o_k = tl.arange(0, BKH)
    m_k1 = o_k < K
    m_k2 = BKH + o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    off_state = (i_bh * K * V).to(tl.int64)
    p_s = o_k[:, None] * V + o_v[None, :]
    S1 = tl.zeros([BKH, BV], dtype=tl.float32)
    S2 = tl.zeros([BKH, BV], dtype=tl.float32)
    if HAS_S0:
        S1 = tl.load(s0 + off_state + p_s, mask=m_k1[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        if TWO:
            S2 = tl.load(s0 + off_state + BKH * V + p_s, mask=m_k2[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    p_pp = o_k[:, None] * (K + V) + o_k[None, :]
    p_pz = o_k[:, None] * (K + V) + K + o_v[None, :]
    for j in range(0, NS):
        if REVERSE:
            i_s = NS - 1 - j
        else:
            i_s = j
        off_seg = ((i_b * NS + i_s) * HV + i_hv).to(tl.int64)
        tl.store(starts + off_seg * K * V + p_s, S1, mask=m_k1[:, None] & m_v[None, :])
        base = pz + off_seg * K * (K + V)
        # Near-fp32 products (three tf32 passes): an error here would reach every later segment. Triton's
        # exact-fp32 ("ieee") dot compiles to scalar FMAs at 32 registers with 8 KB of spills per thread
        # (sm_90, offline), which cost about 0.35 ms per segment on the H200.
        P11 = tl.load(base + p_pp, mask=m_k1[:, None] & m_k1[None, :], other=0.0)
        N1 = tl.dot(P11, S1, input_precision="tf32x3") + tl.load(base + p_pz, mask=m_k1[:, None] & m_v[None, :],
                                                               other=0.0)
        if TWO:
            tl.store(starts + off_seg * K * V + BKH * V + p_s, S2, mask=m_k2[:, None] & m_v[None, :])
            P12 = tl.load(base + BKH + p_pp, mask=m_k1[:, None] & m_k2[None, :], other=0.0)
            P21 = tl.load(base + BKH * (K + V) + p_pp, mask=m_k2[:, None] & m_k1[None, :], other=0.0)
            P22 = tl.load(base + BKH * (K + V) + BKH + p_pp, mask=m_k2[:, None] & m_k2[None, :], other=0.0)
            N1 = tl.dot(P12, S2, N1, input_precision="tf32x3")
            N2 = tl.dot(P21, S1, input_precision="tf32x3") + tl.load(base + BKH * (K + V) + p_pz,
                                                                   mask=m_k2[:, None] & m_v[None, :], other=0.0)
            S2 = tl.dot(P22, S2, N2, input_precision="tf32x3")
        S1 = N1
    tl.store(s_final + off_state + p_s, S1, mask=m_k1[:, None] & m_v[None, :])
    if TWO:
        tl.store(s_final + off_state + BKH * V + p_s, S2, mask=m_k2[:, None] & m_v[None, :])


def segments_for(B: int, HV: int, T: int, V: int, sm_count: int, BT: int = 64) -> int:
    """How many segments to split each sequence into; 1 means keep FLA's sequential kernels.

    The sequential kernels run about B x HV x V / 64 programs. Split only when that
    fills less than half the GPU and segments keep at least 8 chunks each."""
    NT = triton.cdiv(T, BT)
    busy = B * HV * triton.cdiv(V, 64)
    if 2 * busy >= sm_count or NT < 16:
        return 1
    ns = triton.cdiv(2 * sm_count, busy)
    return max(1, min(ns, NT // 8))


SEQUENCE_PARALLEL_ENV = "REWY_HF_SEQUENCE_PARALLEL"


def sequence_segments(k: torch.Tensor, v: torch.Tensor, cu_seqlens, state_v_first: bool = False) -> int:
    """Segments for the sequence-parallel state recurrences (1 = FLA's sequential kernels).

    Opt-in through REWY_HF_SEQUENCE_PARALLEL: ``auto`` splits where the sequential
    kernels would leave most SMs idle (triton_state_scan.segments_for), an integer
    forces that many segments. Packed sequences and the V-first state layout
    keep the sequential kernels, and so does ``auto`` for key head dims above
    MAX_K. Off by default: on the H200 it was slower than
    FLA's sequential kernels at every shape measured (docs/performance.md,
    "The sequence split")."""
    mode = os.environ.get(SEQUENCE_PARALLEL_ENV, "off").strip().lower()
    if mode in ("", "0", "off") or cu_seqlens is not None or state_v_first:
        return 1
    B, T, HV, V = v.shape
    if mode == "auto":
        if k.shape[-1] > MAX_K:
            return 1
        return segments_for(B, HV, T, V, sm_count(k))
    if mode.isdigit() and int(mode) >= 1:
        if int(mode) > 1 and k.shape[-1] > MAX_K:
            raise ValueError(f"{SEQUENCE_PARALLEL_ENV}={mode}: the sequence-parallel recurrences take key head dims "
                             f"up to {MAX_K}, this call has {k.shape[-1]}; use auto (which keeps FLA's sequential "
                             "kernels there) or off")
        return int(mode)
    raise ValueError(f"{SEQUENCE_PARALLEL_ENV}={mode!r} is not understood; use off, auto or a segment count")


MAX_K = 128
SCAN_BV = 16    # [64, 16] state halves next to four fp32 [64, 64] blocks of P: no spills (sm_90, offline)


def _launch(B, T, HV, K, V, NS, fn_args, reverse: bool, dtype_h, s0, vn_like, per_key_gate: bool):
    BT = 64
    NT = triton.cdiv(T, BT)
    L = triton.cdiv(NT, NS)
    NS = triton.cdiv(NT, L)
    if K > MAX_K:
        raise ValueError(f"key head dim {K} > {MAX_K} is not supported by the sequence-parallel recurrence; "
                         f"unset REWY_HF_SEQUENCE_PARALLEL to use FLA's sequential kernels")
    # The state is held as two row halves of BKH rows, so no program holds a K x K or K x V fp32 tile.
    BKH = key_block(K)
    dev = fn_args["k"].device
    f32 = torch.float32
    pz = torch.empty(B, NS, HV, K, K + V, device=dev, dtype=f32)
    common = dict(H=fn_args["k"].shape[2], HV=HV, K=K, V=V, BT=BT, BKH=BKH,
                  USE_G=fn_args["g"] is not None and not per_key_gate,
                  USE_GK=fn_args["g"] is not None and per_key_gate, REVERSE=reverse, FULL_T=T % BT == 0)
    args = [fn_args[n] if fn_args[n] is not None else fn_args["k"] for n in ("k", "w", "u", "g", "q", "do")]
    _segment_kernel[lambda m: (triton.cdiv(K, m["BV"]) + triton.cdiv(V, m["BV"]), NS, B * HV)](
        *args, pz, pz, pz, pz, fn_args["scale"], T, NT, L, FINAL=False, **common)
    starts = torch.empty(B, NS, HV, K, V, device=dev, dtype=f32)
    s_final = torch.empty(B, HV, K, V, device=dev, dtype=f32)
    _scan_kernel[(triton.cdiv(V, SCAN_BV), B * HV)](
        pz, s0 if s0 is not None else pz, starts, s_final, NS, HV, K=K, V=V, BKH=BKH, BV=SCAN_BV,
        HAS_S0=s0 is not None, REVERSE=reverse, num_warps=4)
    h = torch.empty(B, NT, HV, K, V, device=dev, dtype=dtype_h)
    vn = torch.empty_like(vn_like)
    _segment_kernel[lambda m: (triton.cdiv(V, m["BV"]), NS, B * HV)](
        *args, starts, pz, h, vn, fn_args["scale"], T, NT, L, FINAL=True, **common)
    return h, vn, s_final


def _one_gate(g, gk):
    if g is not None and gk is not None:
        raise ValueError("pass either the scalar gate g or the per-key gate gk, not both")
    return gk if gk is not None else g


def state_forward(k, w, u, g, initial_state, NS: int, gk=None):
    """FLA's ``chunk_gated_delta_rule_fwd_h`` (h, v_new, final state), sequence-parallel.

    k: [B, T, H, K]; w: [B, T, HV, K]; u: [B, T, HV, V]; g: [B, T, HV] log2 chunk
    cumsum or None; initial_state: [B, HV, K, V] fp32 or None. For per-key gates
    pass gk ([B, T, HV, K] log2 cumsum) instead of g, and k already gated (kg)."""
    g = _one_gate(g, gk)
    B, T, HV, K = w.shape
    V = u.shape[-1]
    fn_args = dict(k=k.contiguous(), w=w.contiguous(), u=u.contiguous(),
                   g=None if g is None else g.contiguous(), q=None, do=None, scale=1.0)
    s0 = None if initial_state is None else initial_state.float().contiguous()
    return _launch(B, T, HV, K, V, NS, fn_args, False, k.dtype, s0, u, gk is not None)


def state_backward(q, k, w, do, dv, g, dht, scale: float, NS: int, gk=None):
    """FLA's ``chunk_gated_delta_rule_bwd_dhu`` (dh, dh0, dv2), sequence-parallel.

    dh[c] is the gradient of the state leaving chunk c; dh0 that of the initial state.
    Per-key gates: gk instead of g, with q and k already gated (qg, kg), as in FLA."""
    g = _one_gate(g, gk)
    B, T, HV, K = w.shape
    V = do.shape[-1]
    fn_args = dict(k=k.contiguous(), w=w.contiguous(), u=dv.contiguous(),
                   g=None if g is None else g.contiguous(), q=q.contiguous(), do=do.contiguous(), scale=scale)
    s0 = None if dht is None else dht.float().contiguous()
    dh, dv2, dh0 = _launch(B, T, HV, K, V, NS, fn_args, True, q.dtype, s0, dv, gk is not None)
    return dh, dh0, dv2
