"""The forward and backward both Triton gate kinds run: stages, what each policy saves, in one order.

Each gate kind's ``stages`` (``scalar_gate.stages.ScalarGate``: DeltaNet, GDN;
``vector_gate.stages.VectorGate``: KDA, GDN2) supply the stages that differ: the gate's
chunk cumsum, the intra-chunk stage, the output, the recompute of the WY pair, the reverse
state pass and the local ReWY backward. This module owns what both share, in one order:

forward   q/k l2norm -> FLA's chunk table (packed sequences) -> gate cumsum -> intra stage
          -> state recurrence (h entering every chunk, v_new) -> output
saves     the stages' intermediates (``saved_names``): under ``full`` its ``full_saved`` too;
          under ``recompute`` the state checkpoints (flat), empty where the sequential rebuild fills the GPU
backward  (recompute) the stages' recompute, then h and v_new rebuilt (from the checkpoints, or
          sequentially) -> the stages' reverse state pass -> its local backward -> GVA fold
          -> l2norm backward

The inputs themselves are not among the saved tensors: the autograd boundary (kernels/core.py)
keeps them, and ``backward`` receives them again. ``saved_like`` gives the saved tensors' shapes
and dtypes without running anything, for the custom op's fake implementation.

Stage results travel in one ``Tensors`` record. A tensor the later stages no longer read is
dropped from it at once (u after the rebuild, the local dv after the reverse pass), so the next
stage's allocations can reuse its memory.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..constants import CHUNK
from ..core_args import CoreArgs
from . import packed_builds, state_checkpoints, state_launch
from .occupancy import sm_count
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


def state_pass(stages, t: Tensors, call, pk: dict, final: bool, chunks=None):
    """h, v_new, final state: FLA's state recurrence on the stages' inputs (``chunks``: fwd_h's)."""
    return state_launch.fwd_h(**stages.state_inputs(t), u=t.u, initial_state=t.h0, output_final_state=final,
                              chunk_size=CHUNK, state_v_first=call.state_v_first, chunks=chunks, **pk)


def packed_chunks(T, sequences):
    """The most chunks ``sequences`` packed sequences of T tokens in all can have: each begins a
    chunk, so at most one partial chunk per sequence beyond T / CHUNK. The saved tensors of packed
    calls are sized by such bounds of the shapes, not by the lengths (a compiled graph then has no
    size known only at run time); the slots past the real chunks are never read."""
    return -(-T // CHUNK) + sequences - 1


def _chunk_slots(a: CoreArgs):
    """The chunk dim of the saved chunk states: the rows' chunks, or the packed bound."""
    T = a.q.shape[1]
    return -(-T // CHUNK) if a.cu_seqlens is None else packed_chunks(T, a.cu_seqlens.shape[0] - 1)


def _checkpoint_values(a: CoreArgs):
    """The flat size of the saved state checkpoints: their count (exact for rows, the bound for
    packed sequences) x HV x K x V."""
    B, T, _, K = a.q.shape
    HV, V = a.v.shape[2:]
    if a.cu_seqlens is None:
        count = state_checkpoints.dense_count(B, T, HV, V, sm_count(a.v))
    else:
        count = state_checkpoints.packed_count(_chunk_slots(a), a.cu_seqlens.shape[0] - 1, HV, V, sm_count(a.v))
    return count * HV * K * V


def saved_names(stages, a: CoreArgs) -> tuple[str, ...]:
    """The intermediates ``forward`` returns for the backward, in order."""
    names = (("g2",) if a.g is not None else ()) + stages.intra_saved
    if a.qk_l2norm:
        names += ("q", "k", "q_rstd", "k_rstd")
    return names + (stages.full_saved if a.policy == "full" else ("checkpoints",))


def _call(stages, a: CoreArgs) -> SimpleNamespace:
    return SimpleNamespace(scale=a.scale, policy=a.policy, state_v_first=_v_first_inside(stages, a),
                           safe_gate=a.safe_gate)


def _v_first_inside(stages, a: CoreArgs) -> bool:
    """Whether the kernels themselves run in the V-first state layout (the vector gate's take it
    natively; for the scalar gate the state is transposed at the edges)."""
    return a.state_v_first and stages.state_v_first_native


def _state_dims(stages, a: CoreArgs) -> tuple[int, int]:
    """The last two dims of a state inside the kernels: (V, K) in the V-first layout, else (K, V)."""
    K, V = a.k.shape[-1], a.v.shape[-1]
    return (V, K) if _v_first_inside(stages, a) else (K, V)


def _state_in(stages, a: CoreArgs, state):
    """A state in the caller's layout -> the layout the stages' kernels take, float32."""
    if state is None:
        return None
    if a.state_v_first and not stages.state_v_first_native:
        state = state.transpose(-1, -2)
    return state.float().contiguous()


def _state_out(stages, a: CoreArgs, state):
    if a.state_v_first and not stages.state_v_first_native:
        state = state.transpose(-1, -2)
    return state.contiguous()


def _inputs(stages, a: CoreArgs) -> Tensors:
    c = lambda x: None if x is None else x.contiguous()
    return Tensors(q=c(a.q), k=c(a.k), v=c(a.v), beta=c(a.beta), w_gate=c(a.w), h0=_state_in(stages, a, a.h0))


def forward(stages, a: CoreArgs):
    """(o, final state in the caller's layout, the tensors of ``saved_names``)."""
    if a.v.is_cuda:             # builds are compiled and tuned on a GPU only, not under the interpreter
        packed_builds.prepare(stages, a, forward, backward)
    call = _call(stages, a)
    t = _inputs(stages, a)
    t.q, t.q_rstd = normalize(t.q, a.qk_l2norm)
    t.k, t.k_rstd = normalize(t.k, a.qk_l2norm)
    pk = packing(a.cu_seqlens)
    t.g2 = stages.gate_cumsum(None if a.g is None else a.g.contiguous(), pk)
    stages.intra(t, call, pk)
    t.h, t.v_new, ht = state_pass(stages, t, call, pk, final=True,
                                  chunks=_chunk_slots(a) if a.policy == "full" else None)
    o = stages.output(t, call, pk)
    if a.policy != "full":
        t.checkpoints = state_checkpoints.kept(t.h, t.h0, state_checkpoints.plan(t.v, a.cu_seqlens),
                                               _checkpoint_values(a))
    return o.to(a.v.dtype), _state_out(stages, a, ht), [getattr(t, n) for n in saved_names(stages, a)]


def saved_like(stages, a: CoreArgs, dynamic_size) -> list[torch.Tensor]:
    """Empty tensors shaped as ``forward``'s saved ones, every size a function of the input shapes
    (packed calls: the bounds of ``packed_chunks``); ``dynamic_size`` is not needed here."""
    B, T, H, K = a.q.shape
    HV = a.v.shape[2]
    state = _state_dims(stages, a)
    f32 = torch.float32
    fixed = dict(g2=(a.g.shape if a.g is not None else None, f32), A=((B, T, HV, CHUNK), a.k.dtype),
                 Aqk=((B, T, HV, CHUNK), a.k.dtype), Akk=((B, T, HV, CHUNK), a.k.dtype),
                 q=(a.q.shape, a.q.dtype), k=(a.k.shape, a.k.dtype), q_rstd=((B, T, H), f32),
                 k_rstd=((B, T, H), f32), w=((B, T, HV, K), a.k.dtype), qg=((B, T, HV, K), a.k.dtype),
                 kg=((B, T, HV, K), a.k.dtype), v_new=(a.v.shape, a.v.dtype))

    def shape(name: str):
        if name == "h":
            return (B, _chunk_slots(a), HV, *state), a.k.dtype
        if name == "checkpoints":
            return (_checkpoint_values(a),), f32 if a.h0 is not None else a.k.dtype
        return fixed[name]

    return [a.q.new_empty(sz, dtype=dt) for sz, dt in map(shape, saved_names(stages, a))]


def backward(stages, a: CoreArgs, saved: list, do: torch.Tensor, dht: torch.Tensor | None):
    """(dq, dk, dv, dg, dbeta, dw, dh0) in the inputs' shapes and dtypes; None where an input is None."""
    call = _call(stages, a)
    t = _inputs(stages, a)
    t.q_rstd = t.k_rstd = t.g2 = None            # present in the saved list only when the call has them
    t.__dict__.update(zip(saved_names(stages, a), saved))
    pk = packing(a.cu_seqlens)
    do = do.contiguous()
    dht = _state_in(stages, a, dht)
    if a.policy != "full":
        stages.recompute(t, do, call, pk)
        segments = state_checkpoints.plan(t.v, a.cu_seqlens)
        if segments is not None and segments.cuts:
            HV, dims = a.v.shape[2], _state_dims(stages, a)
            states = t.checkpoints[:segments.count * HV * dims[0] * dims[1]].view(segments.count, HV, *dims)
            t.h, t.v_new = state_checkpoints.rebuild(states, segments, t.u, **stages.state_inputs(t),
                                                     state_v_first=call.state_v_first)
        else:
            t.h, t.v_new, _ = state_pass(stages, t, call, pk, final=False)
        t.u = t.checkpoints = None              # freed before the reverse pass allocates dh
    dh, dh0, dv2 = stages.reverse(t, do, dht, call, pk)
    dq, dk, dv, dg, db, dw = stages.local_backward(t, do, dh, dv2, call, pk)
    dq, dk = fold_gva(dq, dk, t.q.shape[2])
    dq, dk = normalize_backward(t.q, t.q_rstd, dq), normalize_backward(t.k, t.k_rstd, dk)
    return (dq.to(a.q.dtype), dk.to(a.k.dtype), dv.to(a.v.dtype), None if a.g is None else dg.to(a.g.dtype),
            db.to(a.beta.dtype), None if dw is None else dw.to(a.w.dtype),
            None if a.h0 is None else _state_out(stages, a, dh0).to(a.h0.dtype))
