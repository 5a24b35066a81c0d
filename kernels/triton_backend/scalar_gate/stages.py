"""The stages of the Triton backend for GDN and DeltaNet (scalar gate per token and head; CUDA).

Forward: FLA 0.6.0's stages in FLA's order, their kernels launched by rewy
(fla_stages.py, state_launch.py): the chunk-local gate cumsum in log2 units,
the intra-chunk WY pair w, u and A, the state recurrence h / v_new, the
output. Backward, after the shared skeleton's
rebuild of h (function.py):

- ``recompute`` rebuilds w and u in rewy's fused prestage (prestage.py),
  which also forms the local value gradient dV_loc = Aqk^T dO.
- ``full`` saves w, h and v_new (u is not needed: the local kernel reads
  neither w nor u, and the reverse recurrence needs only w) and runs FLA's
  local dv.
- Under both, the reverse state recurrence is rewy's walk (reverse_walk.py)
  for key head dims up to 128, FLA's ``bwd_dhu`` above.
- rewy's local kernel (local_backward.py) then computes every input gradient
  of the chunk: all that ReWY rewrites, in place of FLA's ``chunk_bwd_dqkwg``
  (which FLA 0.6.0 refuses to run on Hopper with Triton < 3.7.1) and
  ``prepare_wy_repr_bwd``.

The gate and beta arrive activated. Layout [B, T, H, D]; the state is
[N, HV, K, V] (the entry point transposes a V-first state).
"""

from __future__ import annotations

from ...constants import CHUNK, LOG_GATE_FLOOR, RCP_LN2
from .. import fla_stages, state_launch
from ..function import Tensors
from . import prestage, reverse_walk
from .local_backward import rewy_gdn_bwd_local


class ScalarGate:
    """GDN (g: [B, T, HV] log-decay) and DeltaNet (g None)."""

    intra_saved = ("A",)
    full_saved = ("w", "h", "v_new")
    state_v_first_native = False        # the state is transposed at the edges (function.py)

    @staticmethod
    def gate_cumsum(g, pk):
        if g is None:
            return None
        return fla_stages.gate_cumsum(g.float().clamp_min(LOG_GATE_FLOOR), scale=RCP_LN2, chunk_size=CHUNK, **pk)

    @staticmethod
    def intra(t: Tensors, call, pk):
        t.w, t.u, t.A = fla_stages.gdn_intra(t.k, t.v, t.g2, t.beta, **pk)

    @staticmethod
    def state_inputs(t: Tensors) -> dict:
        return dict(k=t.k, w=t.w, g=t.g2)

    @staticmethod
    def output(t: Tensors, call, pk):
        return fla_stages.gdn_output(t.q, t.k, t.v_new, t.h, t.g2, call.scale, chunk_size=CHUNK, **pk)

    @staticmethod
    def recompute(t: Tensors, do, call, pk):
        t.w, t.u, t.dv_local = prestage.recompute_wu_and_dv_local(t.q, t.k, t.v, t.beta, t.A, do, g=t.g2,
                                                                  scale=call.scale, **pk)

    @staticmethod
    def reverse(t: Tensors, do, dht, call, pk):
        dv_local = getattr(t, "dv_local", None)     # dv2 holds it after the recurrence; freed before the local kernel
        t.dv_local = None
        if dv_local is None:
            dv_local = fla_stages.dv_local(q=t.q, k=t.k, do=do, g=t.g2, scale=call.scale, chunk_size=CHUNK, **pk)
        if reverse_walk.takes(t.k):
            return reverse_walk.reverse_walk(t.q, t.k, t.w, do, dv_local, g=t.g2, h0=t.h0, dht=dht,
                                             scale=call.scale, **pk)
        return state_launch.bwd_dhu(q=t.q, k=t.k, w=t.w, do=do, dv=dv_local, g=t.g2, h0=t.h0, dht=dht,
                                    scale=call.scale, chunk_size=CHUNK, **pk)

    @staticmethod
    def local_backward(t: Tensors, do, dh, dv2, call, pk):
        dq, dk, dv, dg, db = rewy_gdn_bwd_local(t.q, t.k, t.v, t.v_new, t.g2, t.beta, t.A, t.h, dh, do, dv2,
                                                scale=call.scale, **pk)
        return dq, dk, dv, dg, db, None
