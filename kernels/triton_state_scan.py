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


@triton.jit
def _segment_kernel(
    k, w, u, g, q, do, start, pz_out, h_out, vn_out,
    scale, T, NT, L,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
    USE_G: tl.constexpr, USE_GK: tl.constexpr, AUGMENTED: tl.constexpr, REVERSE: tl.constexpr,
):
    """One segment of the forward (REVERSE=False) or backward (REVERSE=True)
    recurrence for one column block of the state.

    AUGMENTED: columns [0, K) of the state start as I and see no inputs,
    columns [K, K + V) start at 0; the end state is written to pz_out
    [B, NS, HV, K, K + V]. Otherwise the state (V columns) starts from
    ``start`` [B, NS, HV, K, V] (fp32) and h_out / vn_out get the per-chunk
    states and the per-token v_new (forward) or dh and dv2 (backward).
    Backward reads w where the forward reads w, dv (FLA's local dv) where the
    forward reads u, and q, do for the output term.
    USE_GK (KDA, GDN2): g is the per-key log2 gate cumsum [B, T, HV, K] and, as
    in FLA, k and q arrive already gated (kg = k e^{G_C - G}, qg = q e^{G}); the
    state decays row by row by e^{G_C}.
    """
    i_c, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    NS = tl.num_programs(1)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_t = tl.arange(0, BT)
    cols = i_c * BC + tl.arange(0, BC)               # state columns of this program
    if AUGMENTED:
        is_input = cols >= K                          # P columns see no inputs
        v_cols = cols - K
        m_c = cols < K + V
        m_in = is_input & m_c
        b_s = tl.where((o_k[:, None] == cols[None, :]) & m_k[:, None], 1.0, 0.0).to(tl.float32)
    else:
        v_cols = cols
        m_c = cols < V
        m_in = m_c
        off_start = (((i_b * NS + i_s) * HV + i_hv) * K * V).to(tl.int64)
        b_s = tl.load(start + off_start + o_k[:, None] * V + cols[None, :],
                      mask=m_k[:, None] & m_c[None, :], other=0.0).to(tl.float32)

    c0 = i_s * L
    n = tl.minimum(L, NT - c0)
    for j in range(0, n):
        i_t = c0 + j
        if REVERSE:
            i_t = c0 + n - 1 - j
        rows = i_t * BT + o_t
        m_t = rows < T
        tok = (i_b * T + rows).to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + (tok * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_w = tl.load(w + (tok * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        last = (i_b * T + tl.minimum(T, i_t * BT + BT) - 1).to(tl.int64)
        if USE_G:
            b_g = tl.load(g + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
            b_gl = tl.load(g + last * HV + i_hv).to(tl.float32)
            b_kdecay = tl.where(m_t, tl.exp2(b_gl - b_g), 0.0)
        elif USE_GK:
            b_gl = tl.exp2(tl.load(g + (last * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32))[:, None]
            b_kdecay = tl.where(m_t, 1.0, 0.0)
        else:
            b_gl = 0.0
            b_kdecay = tl.where(m_t, 1.0, 0.0)
        off_tv = (tok * HV + i_hv)[:, None] * V + v_cols[None, :]
        m_tv = m_t[:, None] & m_in[None, :]
        if not AUGMENTED:
            off_state = (((i_b * NT + i_t) * HV + i_hv) * K * V).to(tl.int64)
            tl.store(h_out + off_state + o_k[:, None] * V + cols[None, :], b_s.to(h_out.dtype.element_ty),
                     mask=m_k[:, None] & m_c[None, :])
        # u (forward) or FLA's local dv (backward): the input term of this chunk.
        b_in = tl.load(u + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        if REVERSE:
            # dv2 = dv + k_g D;  D <- e^{g_C} D + scale q_g^T do - w^T dv2
            b_kg = (b_k.to(tl.float32) * b_kdecay[:, None]).to(b_k.dtype)
            b_dv2 = b_in + tl.dot(b_kg, b_s.to(b_k.dtype))
            if not AUGMENTED:
                tl.store(vn_out + off_tv, b_dv2.to(vn_out.dtype.element_ty), mask=m_tv)
            b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
            b_q = tl.load(q + (tok * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            if USE_G:
                b_q = b_q * tl.exp2(b_g)[:, None]
            b_s = b_s * b_gl if USE_GK else b_s * tl.exp2(b_gl)
            b_s += scale * tl.dot(tl.trans(b_q.to(b_k.dtype)), b_do.to(b_k.dtype))
            b_s -= tl.dot(tl.trans(b_w), b_dv2.to(b_w.dtype))
        else:
            # v_new = u - w h;  h <- e^{g_C} h + k_g^T v_new
            b_vn = b_in - tl.dot(b_w, b_s.to(b_w.dtype))
            if not AUGMENTED:
                tl.store(vn_out + off_tv, b_vn.to(vn_out.dtype.element_ty), mask=m_tv)
            b_vn = b_vn * b_kdecay[:, None]
            b_s = (b_s * b_gl if USE_GK else b_s * tl.exp2(b_gl)) + tl.dot(tl.trans(b_k), b_vn.to(b_k.dtype))

    if AUGMENTED:
        off_pz = (((i_b * NS + i_s) * HV + i_hv) * K * (K + V)).to(tl.int64)
        tl.store(pz_out + off_pz + o_k[:, None] * (K + V) + cols[None, :], b_s, mask=m_k[:, None] & m_c[None, :])


@triton.jit
def _scan_kernel(pz, s0, starts, s_final,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 HAS_S0: tl.constexpr, REVERSE: tl.constexpr, NS, HV):
    """Boundary states: S <- P_s S + Z_s over the segments (in reverse for the
    backward), writing each segment's start state and the state after all."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    off_state = (i_bh * K * V).to(tl.int64)
    if HAS_S0:
        b_s = tl.load(s0 + off_state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    for j in range(0, NS):
        i_s = j
        if REVERSE:
            i_s = NS - 1 - j
        off_seg = ((i_b * NS + i_s) * HV + i_hv).to(tl.int64)
        tl.store(starts + off_seg * K * V + o_k[:, None] * V + o_v[None, :], b_s, mask=m_kv)
        base = pz + off_seg * K * (K + V)
        b_p = tl.load(base + o_k[:, None] * (K + V) + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        b_z = tl.load(base + o_k[:, None] * (K + V) + K + o_v[None, :], mask=m_kv, other=0.0)
        # fp32 product in full precision: errors here would reach every later segment.
        b_s = tl.dot(b_p, b_s, input_precision="ieee") + b_z
    tl.store(s_final + off_state + o_k[:, None] * V + o_v[None, :], b_s, mask=m_kv)


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
    keep the sequential kernels. Off by default until its GPU timing is in
    docs/performance.md."""
    mode = os.environ.get(SEQUENCE_PARALLEL_ENV, "off").strip().lower()
    if mode in ("", "0", "off") or cu_seqlens is not None or state_v_first:
        return 1
    B, T, HV, V = v.shape
    if mode == "auto":
        sms = torch.cuda.get_device_properties(k.device).multi_processor_count if k.is_cuda else 132
        return segments_for(B, HV, T, V, sms)
    if mode.isdigit() and int(mode) >= 1:
        return int(mode)
    raise ValueError(f"{SEQUENCE_PARALLEL_ENV}={mode!r} is not understood; use off, auto or a segment count")


def _launch(B, T, HV, K, V, NS, fn_args, reverse: bool, dtype_h, s0, vn_like, per_key_gate: bool):
    BT = 64
    NT = triton.cdiv(T, BT)
    L = triton.cdiv(NT, NS)
    NS = triton.cdiv(NT, L)
    BK = max(16, triton.next_power_of_2(K))
    if BK > 256:
        raise ValueError(f"key head dim {K} > 256 is not supported by the sequence-parallel recurrence")
    BC = 64 if BK <= 128 else 32
    dev = fn_args["k"].device
    f32 = torch.float32
    pz = torch.empty(B, NS, HV, K, K + V, device=dev, dtype=f32)
    common = dict(H=fn_args["k"].shape[2], HV=HV, K=K, V=V, BT=BT, BK=BK, BC=BC,
                  USE_G=fn_args["g"] is not None and not per_key_gate,
                  USE_GK=fn_args["g"] is not None and per_key_gate, REVERSE=reverse)
    args = [fn_args[n] if fn_args[n] is not None else fn_args["k"] for n in ("k", "w", "u", "g", "q", "do")]
    _segment_kernel[(triton.cdiv(K + V, BC), NS, B * HV)](
        *args, pz, pz, pz, pz, fn_args["scale"], T, NT, L, AUGMENTED=True, **common)
    starts = torch.empty(B, NS, HV, K, V, device=dev, dtype=f32)
    s_final = torch.empty(B, HV, K, V, device=dev, dtype=f32)
    BV = 32 if BK > 64 else 64
    _scan_kernel[(triton.cdiv(V, BV), B * HV)](
        pz, s0 if s0 is not None else pz, starts, s_final, K=K, V=V, BK=BK, BV=BV,
        HAS_S0=s0 is not None, REVERSE=reverse, NS=NS, HV=HV, num_warps=8)   # P is a whole K x K fp32 tile
    h = torch.empty(B, NT, HV, K, V, device=dev, dtype=dtype_h)
    vn = torch.empty_like(vn_like)
    _segment_kernel[(triton.cdiv(V, BC), NS, B * HV)](
        *args, starts, pz, h, vn, fn_args["scale"], T, NT, L, AUGMENTED=False, **common)
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
