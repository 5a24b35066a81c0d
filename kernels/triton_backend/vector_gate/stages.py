"""The stages of the Triton backend for KDA and GDN2 (vector gates per key channel; CUDA).

Forward: FLA 0.6.0's stages in FLA's order: the chunk-local gate cumsum in
log2 units (``chunk_local_cumsum``), the intra-chunk stage
(``chunk_kda_fwd_intra`` / ``chunk_gdn2_fwd_intra``: Aqk, A = Akk, w, u,
and kg, qg), the state recurrence (the states h entering each chunk, v_new)
and the output (``chunk_gla_fwd_o_gk``). Each is FLA's kernels launched by
rewy (fla_stages.py, state_launch.py).

Backward, around the shared skeleton (function.py): FLA's stages that ReWY
leaves alone, their kernels launched by rewy -- the w/u/qg/kg recompute
(``recompute`` only), the local dv with dAqk (``chunk_kda_bwd_dAv``, shared
by KDA and GDN2 in FLA) and the reverse state recurrence -- then rewy's two
kernels (backward.py) for what ReWY rewrites: Residual WY plus the
inter-chunk dq/dk/dg terms, and the intra-chunk Gram backward by Matrix
Intra with the gate's reverse cumulative sum.

Policies: ``recompute`` saves what FLA's default saves (inputs, the log2 gate
cumsum, Aqk, Akk) and rebuilds w, qg, kg, h and v_new; ``full`` (FLA's
``disable_recompute=True``) also saves w, qg, kg, v_new and h, but not u,
which the backward never reads (Residual WY needs only Vn).

The gate activation and beta sigmoid are plain torch ops in the caller.
Layout: FLA's [B, T, heads, D]; gates are natural-log per-token gates,
[B, T, HV, K]. The state layout (``state_v_first``) and ``cu_seqlens`` are
handled natively by FLA's stages and by rewy's kernels.
"""

from __future__ import annotations

from ...constants import CHUNK, LOG_GATE_FLOOR, RCP_LN2
from .. import fla_stages, state_launch
from ..function import Tensors
from .backward import rewy_kda_bwd


class VectorGate:
    """KDA (beta [B, T, HV], no write gate) and GDN2 (beta: the erase gate b [B, T, H, K];
    w_gate: the write gate [B, T, H, V])."""

    intra_saved = ("Aqk", "Akk")
    full_saved = ("w", "qg", "kg", "v_new", "h")
    state_v_first_native = True         # FLA's stages and rewy's kernels take either layout

    @staticmethod
    def gate_cumsum(g, pk):
        # floored in g's own dtype: a float32 copy of a [B, T, H, K] gate would cost memory traffic
        return fla_stages.gate_cumsum(g.clamp_min(LOG_GATE_FLOOR), scale=RCP_LN2, chunk_size=CHUNK, **pk)

    @staticmethod
    def intra(t: Tensors, call, pk):
        options = dict(safe_gate=call.safe_gate, disable_recompute=call.policy == "full", **pk)
        if t.w_gate is None:
            stage = fla_stages.kda_intra(t.q, t.k, t.v, t.g2, t.beta, call.scale, **options)
        else:
            stage = fla_stages.gdn2_intra(t.q, t.k, t.v, t.g2, t.beta, t.w_gate, call.scale, **options)
        t.w, t.u, t.qg, t.kg, t.Aqk, t.Akk = stage

    @staticmethod
    def state_inputs(t: Tensors) -> dict:
        return dict(k=t.kg, w=t.w, gk=t.g2)

    @staticmethod
    def output(t: Tensors, call, pk):
        return fla_stages.vector_output(q=t.q, v=t.v_new, g=t.g2, A=t.Aqk, h=t.h, scale=call.scale,
                                        state_v_first=call.state_v_first, chunk_size=CHUNK, **pk)

    @staticmethod
    def recompute(t: Tensors, do, call, pk):
        if t.w_gate is None:
            t.w, t.u, t.qg, t.kg = fla_stages.kda_recompute(t.k, t.v, t.beta, t.Akk, t.g2, q=t.q, **pk)
        else:
            t.w, t.u, t.qg, t.kg = fla_stages.gdn2_recompute(t.k, t.v, t.beta, t.w_gate, t.Akk, t.g2, q=t.q, **pk)

    @staticmethod
    def reverse(t: Tensors, do, dht, call, pk):
        t.dAqk, dv_local = fla_stages.vector_dAv(t.q, t.k, t.v_new, do, t.Aqk, call.scale, chunk_size=CHUNK, **pk)
        # dv_local is dropped on return: dv2 holds it then, before the local kernels allocate
        return state_launch.bwd_dhu(q=t.qg, k=t.kg, w=t.w, do=do, dv=dv_local, gk=t.g2, h0=t.h0, dht=dht,
                                    scale=call.scale, state_v_first=call.state_v_first, chunk_size=CHUNK, **pk)

    @staticmethod
    def local_backward(t: Tensors, do, dh, dv2, call, pk):
        # Without GVA the kernels write dq, dk (and GDN2's db) in the input dtypes: no conversion pass after them.
        return rewy_kda_bwd(t.q, t.k, t.v, t.v_new, t.g2, t.beta, t.Akk, t.h, dh, do, dv2, t.dAqk, call.scale,
                            w_gate=t.w_gate, state_v_first=call.state_v_first, cu_seqlens=pk.get("cu_seqlens"),
                            chunk_indices=pk.get("chunk_indices"), final_dtypes=t.q.shape[2] == t.v.shape[2])
