"""Context parallelism: one packed row of sequences split across ranks, with FLA's exchange.

FLA 0.6.0's protocol (``fla.ops.cp``, ``build_cp_context``) gives each rank a
contiguous slice of the packed tokens and its local ``cu_seqlens``; a sequence
may start on one rank and end several ranks later. The delta rule's state map
over a stretch of tokens is affine, and so is its gradient's:

    forward:   h_out  = M h_in + h_loc        (h_loc: the state reached from h_in = 0)
    backward:  dh_in  = M^T dh_out + dh_loc   (dh_loc: the gradient reached from dh_out = 0)

so each rank summarises the stretch of its sequence that continues on another
rank as [h_loc | M] (forward, its last local sequence) or [dh_loc | M^T]
(backward, its first local sequence), each [HV, K, V + K] in float32 (float64
for float64 inputs), and every rank all-gathers the summaries once per pass,
as FLA does. A rank then composes the summaries of the ranks its first
sequence came through (forward, in rank order) or its last sequence goes on to
(backward, in reverse), and runs its ordinary core with that state as its
first sequence's initial state and that gradient as its last sequence's final
state gradient. So every rank's backward is rewy's own.

How the summaries are formed, with the core itself (any backend): a state
column evolves on its own, linearly in (h_in, v). h_loc is the final state of
the sequence's tokens run from h_in = 0. M is the final state of the same
tokens run with v = 0 and h_in = I (K value columns); that run's output O
(K columns) is the output's response to the initial state, o = O h_in, so
dh_loc = O^T do. These extra runs are made without autograd: the forward runs
the last local sequence twice (h_loc, then M), the backward runs the first
one once more with v = 0 (O and M): a forward of that sequence, so that no
saved tensor has a size only the run knows (O's length is the first
sequence's), which a compiled graph could not hold without breaking.

Both exchanges are custom ops (``rewy::cp_initial_state``, which also forms
this rank's forward summary, and ``rewy::cp_final_state_grad``), and the
call's per-row values reach them as tensors (context_parallel_call.py), so a
compiled model keeps one graph through its context-parallel layers, and a
new packing of the row compiles nothing new once the number of local
sequences is a dynamic size (dynamo makes it one at its first change).

Restrictions, as in FLA: B = 1 packed input, no user initial state, no final
state, the contiguous layout (FLA's ``zigzag`` layout is refused with a
message). Unlike FLA, a context without a process group is refused: FLA runs
it as a plain packed call of the slice, from a zero state.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .errors import UnsupportedConfigError
from .context_parallel_call import (IS_FIRST, IS_LAST, POST_RANKS, PRE_RANKS, CPCall, check_slice, gather_ranks,
                                    process_group)
from .core import delta_rule
from .core_args import CoreArgs


def check_call(op: str, q: Tensor, initial_state, output_final_state: bool) -> None:
    """FLA's restrictions on a context-parallel call, with their fixes."""
    if q.shape[0] != 1:
        raise UnsupportedConfigError(f"{op}: context parallelism takes packed input, B = 1 (got B = {q.shape[0]}); "
                                     "join the batch into one row with cu_seqlens.")
    if initial_state is not None or output_final_state:
        raise UnsupportedConfigError(f"{op}: context parallelism takes no initial_state and no final state "
                                     "(as FLA); leave initial_state=None and output_final_state=False.")


def _state_dtype(q: Tensor) -> torch.dtype:
    """The summaries' dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _tokens(a: CoreArgs, start: int, end: int, **changes) -> CoreArgs:
    """The call restricted to tokens [start, end) of its row, as one sequence, no report."""
    def cut(x):
        return None if x is None else x[:, start:end]
    return replace(a, q=cut(a.q), k=cut(a.k), v=cut(a.v), g=cut(a.g), beta=cut(a.beta), w=cut(a.w), h0=None,
                   cu_seqlens=None, state_v_first=False, report_as="", **changes)


def _zero_value_run(a: CoreArgs, backend: str):
    """(O [1, T, HV, K], M [HV, K, K]) of a one-sequence call: v = 0, h_in = I."""
    HV, K = a.v.shape[2], a.q.shape[-1]
    dt = _state_dtype(a.q)
    v = a.v.new_zeros(*a.v.shape[:3], K)
    w = None if a.w is None else a.w.new_ones(*a.w.shape[:3], K)
    eye = torch.eye(K, dtype=dt, device=a.q.device).expand(1, HV, K, K).contiguous()
    o, ht = delta_rule(replace(a, v=v, w=w, h0=eye), backend)
    return o, ht[0].to(dt)


def _compose(summaries: torch.Tensor, ranks: list[int], V: int) -> torch.Tensor:
    """x <- M x + x_loc over the ranks in the given order, from x = 0 (summaries [W, HV, K, V + K])."""
    x = summaries.new_zeros(summaries.shape[1:3] + (V,))
    for r in ranks:
        x = summaries[r, ..., V:] @ x + summaries[r, ..., :V]
    return x


def cp_delta_rule(a: CoreArgs, backend: str, call: CPCall) -> Tensor:
    """o of a context-parallel call (``a.cu_seqlens``: this rank's local bounds)."""
    # No gradient flows through the summaries: the backward exchange carries it across ranks.
    inputs = [None if x is None else x.detach() for x in (a.q, a.k, a.v, a.g, a.beta, a.w)]
    settings = (a.scale, a.family, a.policy, a.qk_l2norm, a.safe_gate, backend)
    h0 = torch.ops.rewy.cp_initial_state(*inputs, call.bounds, call.meta, call.group_name, *settings)
    o, ht = delta_rule(replace(a, h0=h0, state_v_first=False), backend)
    return _NextRanksGradient.apply(o, ht, inputs, call, settings)


def _one_sequence_args(q, k, v, g, beta, w, scale, family, policy, qk_l2norm, safe_gate) -> CoreArgs:
    return CoreArgs(q=q, k=k, v=v, g=g, beta=beta, w=w, h0=None, cu_seqlens=None, scale=scale, family=family,
                    policy=policy, state_v_first=False, qk_l2norm=qk_l2norm, safe_gate=safe_gate)


@torch.library.custom_op("rewy::cp_initial_state", mutates_args=())
def _initial_state(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, w: Tensor | None,
                   bounds: Tensor, meta: Tensor, group_name: str, scale: float, family: str, policy: str,
                   qk_l2norm: bool, safe_gate: bool, backend: str) -> Tensor:
    """h0 [N, HV, K, V]: the initial states of this rank's sequences, the first one's composed from
    the gathered forward summaries of the ranks it came through (zero elsewhere and on a first rank)."""
    # Before the core's own check of the bounds, which would name cu_seqlens, an argument a
    # context-parallel caller did not pass.
    check_slice(bounds, q.shape[1])
    a = _one_sequence_args(q, k, v, g, beta, w, scale, family, policy, qk_l2norm, safe_gate)
    group = process_group(group_name)
    rank = torch.distributed.get_rank(group=group)
    ends = bounds.tolist()
    is_first, is_last, pre_ranks = (int(meta[i]) for i in (IS_FIRST, IS_LAST, PRE_RANKS))
    HV, V = v.shape[2:]
    K, dt = q.shape[-1], _state_dtype(a.q)
    # Forward summary of the last local sequence, which goes on to the next rank.
    summary = q.new_zeros(HV, K, V + K, dtype=dt)
    if not is_last:
        last = _tokens(a, ends[-2], ends[-1])
        summary[..., :V] = delta_rule(last, backend)[1][0].to(dt)
        summary[..., V:] = _zero_value_run(last, backend)[1]
    gathered = gather_ranks(summary, group)
    h0 = q.new_zeros(len(ends) - 1, HV, K, V, dtype=dt)
    if not is_first:
        h0[0] = _compose(gathered, list(range(rank - pre_ranks, rank)), V)
    return h0


@_initial_state.register_fake
def _initial_state_fake(q, k, v, g, beta, w, bounds, meta, group_name, scale, family, policy, qk_l2norm, safe_gate,
                        backend):
    return q.new_empty(bounds.shape[0] - 1, v.shape[2], q.shape[-1], v.shape[3], dtype=_state_dtype(q))


@torch.library.custom_op("rewy::cp_final_state_grad", mutates_args=())
def _final_state_grad(do: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor,
                      w: Tensor | None, bounds: Tensor, meta: Tensor, group_name: str, scale: float, family: str,
                      policy: str, qk_l2norm: bool, safe_gate: bool, backend: str) -> Tensor:
    """dht [N, HV, K, V]: the gradient of this rank's sequences' final states, which the following
    ranks' outputs give (the last sequence's; zero elsewhere and on a last rank). The first
    sequence's response to its initial state (O, M) is rebuilt here from the inputs rather than
    kept from the forward (module docstring)."""
    a = _one_sequence_args(q, k, v, g, beta, w, scale, family, policy, qk_l2norm, safe_gate)
    group = process_group(group_name)
    rank = torch.distributed.get_rank(group=group)
    ends = bounds.tolist()
    is_first, is_last, post_ranks = (int(meta[i]) for i in (IS_FIRST, IS_LAST, POST_RANKS))
    HV, V, K, dt = v.shape[2], v.shape[3], q.shape[-1], _state_dtype(a.q)
    summary = do.new_zeros(HV, K, V + K, dtype=dt)
    if not is_first:
        O, M = _zero_value_run(_tokens(a, ends[0], ends[1]), backend)
        first = do[0, ends[0]:ends[1]].to(dt)
        summary[..., :V] = torch.einsum("thk,thv->hkv", O[0].to(dt), first)
        summary[..., V:] = M.transpose(-1, -2)
    gathered = gather_ranks(summary, group)
    dht = do.new_zeros(len(ends) - 1, HV, K, V, dtype=dt)
    if not is_last:
        dht[-1] = _compose(gathered, list(range(rank + post_ranks, rank, -1)), V)
    return dht


@_final_state_grad.register_fake
def _final_state_grad_fake(do, q, k, v, g, beta, w, bounds, meta, group_name, scale, family, policy, qk_l2norm,
                           safe_gate, backend):
    return do.new_empty(bounds.shape[0] - 1, v.shape[2], q.shape[-1], v.shape[3], dtype=_state_dtype(q))


class _NextRanksGradient(torch.autograd.Function):
    """Identity on o; its backward exchanges the backward summaries and hands the core the
    gradient of its last sequence's final state, which the following ranks' outputs give."""

    @staticmethod
    def forward(fctx, o, ht, inputs: list, call: CPCall, settings: tuple):
        fctx.save_for_backward(*inputs, call.bounds, call.meta)
        fctx.group_name, fctx.settings = call.group_name, settings
        return o.view_as(o)

    @staticmethod
    def backward(fctx, do):
        *inputs, bounds, meta = fctx.saved_tensors
        dht = torch.ops.rewy.cp_final_state_grad(do.contiguous(), *inputs, bounds, meta, fctx.group_name,
                                                 *fctx.settings)
        return do, dht, None, None, None
