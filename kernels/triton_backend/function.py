"""The autograd Function both Triton families run: forward stages, what each policy saves, backward stages.

A family (``scalar_gate.stages.ScalarGate``: DeltaNet, GDN; ``vector_gate.stages.VectorGate``:
KDA, GDN2) supplies the stages that differ: the gate's chunk cumsum, the intra-chunk stage, the
output, the recompute of the WY pair, the reverse state pass and the local ReWY backward. This
skeleton owns what both share, in one order:

forward   q/k l2norm -> FLA's chunk table (packed sequences) -> gate cumsum -> intra stage
          -> state recurrence (h entering every chunk, v_new) -> output
saves     the family's ``saved`` names; under ``full`` its ``full_saved`` names too; under
          ``recompute`` the state checkpoints where the sequential rebuild would starve the GPU
backward  (recompute) the family's recompute, then h and v_new rebuilt (from the checkpoints, or
          sequentially) -> the family's reverse state pass -> its local backward -> GVA fold
          -> l2norm backward

Stage results travel in one ``Tensors`` record. A tensor the later stages no longer read is
dropped from it at once (u after the rebuild, the local dv after the reverse pass), so the next
stage's allocations can reuse its memory.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..constants import CHUNK
from . import state_checkpoints, state_launch
from .qk_l2norm import normalize, normalize_backward


class Tensors(SimpleNamespace):
    """The stage results of one call by name. A stage that may find a result absent asks with
    ``getattr(t, name, None)``; any other absent name is an AttributeError, so a misspelt name
    cannot read as None."""


def packing(cu_seqlens: torch.Tensor | None) -> dict:
    """The packing arguments every FLA stage takes: cu_seqlens and FLA's (sequence, chunk) table."""
    if cu_seqlens is None:
        return {}
    from fla.ops.utils import prepare_chunk_indices

    return dict(cu_seqlens=cu_seqlens, chunk_indices=prepare_chunk_indices(cu_seqlens, CHUNK))


def fold_gva(dq, dk, key_heads: int):
    """dq, dk computed per value head [B, T, HV, K] -> per key head [B, T, H, K]:
    under GVA each key head serves HV // H value heads, so their gradients add."""
    B, T, HV, K = dq.shape
    group = HV // key_heads
    if group == 1:
        return dq, dk
    return dq.view(B, T, key_heads, group, K).sum(3), dk.view(B, T, key_heads, group, K).sum(3)


def state_pass(family, t: Tensors, call, pk: dict, final: bool):
    """h, v_new, final state: FLA's state recurrence on the family's inputs."""
    return state_launch.fwd_h(**family.state_inputs(t), u=t.u, initial_state=t.h0, output_final_state=final,
                              chunk_size=CHUNK, state_v_first=call.state_v_first, **pk)


class ReWYTritonFunction(torch.autograd.Function):
    """o, ht = f(q, k, v, g, beta, w_gate, h0) for ``family``. ``call``: the call's settings
    (scale, policy, state_v_first, safe_gate), a ``SimpleNamespace``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, w_gate, h0, family, call, cu_seqlens, qk_l2norm: bool):
        ctx.set_materialize_grads(False)       # no zero tensors for an unused output or final state
        q, q_rstd = normalize(q, qk_l2norm)
        k, k_rstd = normalize(k, qk_l2norm)
        pk = packing(cu_seqlens)
        t = Tensors(q=q, k=k, v=v, beta=beta, w_gate=w_gate, h0=h0, q_rstd=q_rstd, k_rstd=k_rstd, **pk)
        t.g2 = family.gate_cumsum(g, pk)
        family.intra(t, call, pk)
        t.h, t.v_new, ht = state_pass(family, t, call, pk, final=True)
        o = family.output(t, call, pk)
        names = family.saved + tuple(pk)
        segments = None
        if call.policy == "full":
            names += family.full_saved
        else:
            segments = state_checkpoints.plan(v, cu_seqlens)
            if segments is not None:
                t.checkpoints = state_checkpoints.save(t.h, h0, segments)
                names += ("checkpoints",)
        ctx.save_for_backward(*(getattr(t, n) for n in names))
        ctx.names, ctx.segments, ctx.family, ctx.call = names, segments, family, call
        ctx.g_dtype = None if g is None else g.dtype
        return o.to(v.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        family, call = ctx.family, ctx.call
        t = Tensors(**dict(zip(ctx.names, ctx.saved_tensors)))
        pk = {n: getattr(t, n) for n in ("cu_seqlens", "chunk_indices") if n in ctx.names}
        do = torch.zeros_like(t.v) if do is None else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        if call.policy != "full":
            family.recompute(t, do, call, pk)
            if ctx.segments is not None:
                t.h, t.v_new = state_checkpoints.rebuild(t.checkpoints, ctx.segments, t.u, **family.state_inputs(t),
                                                         state_v_first=call.state_v_first)
            else:
                t.h, t.v_new, _ = state_pass(family, t, call, pk, final=False)
            t.u = t.checkpoints = None              # freed before the reverse pass allocates dh
        dh, dh0, dv2 = family.reverse(t, do, dht, call, pk)
        dq, dk, dv, dg, db, dw = family.local_backward(t, do, dh, dv2, call, pk)
        dq, dk = fold_gva(dq, dk, t.q.shape[2])
        dq, dk = normalize_backward(t.q, t.q_rstd, dq), normalize_backward(t.k, t.k_rstd, dk)
        return (dq, dk, dv.to(t.v.dtype), None if ctx.g_dtype is None else dg.to(ctx.g_dtype),
                db.to(t.beta.dtype), None if dw is None else dw.to(t.w_gate.dtype),
                dh0 if t.h0 is not None else None, None, None, None, None)
