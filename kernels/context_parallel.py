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
dh_loc = O^T do. These extra forwards run without autograd; the backward adds
one small product, no extra pass.

Restrictions, as in FLA: B = 1 packed input, no user initial state, no final
state, the contiguous layout (FLA's ``zigzag`` layout is refused with a
message), and the call runs eagerly (it holds collectives).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError
from .core import delta_rule
from .core_args import CoreArgs


def check_context(op: str, ctx, q: torch.Tensor, initial_state, output_final_state: bool) -> torch.Tensor:
    """The local ``cu_seqlens`` of a CP call after the checks FLA makes, with their fixes."""
    fields = ("group", "cu_seqlens", "is_first_rank", "is_last_rank", "pre_num_ranks", "post_num_ranks")
    if not all(hasattr(ctx, f) for f in fields):
        raise UnsupportedConfigError(f"{op}: cp_context must be FLA's context, got {type(ctx).__name__}; build it "
                                     "with fla.ops.cp.build_cp_context(cu_seqlens, group=...).")
    if getattr(ctx, "layout", "contiguous") != "contiguous":
        raise UnsupportedConfigError(
            f"{op}: cp_context with layout={ctx.layout!r} is not supported by rewy-hf; build it with "
            "fla.ops.cp.build_cp_context(..., layout='contiguous') (the default).")
    if ctx.cu_seqlens is None:
        raise UnsupportedConfigError(f"{op}: cp_context has no cu_seqlens; build it with "
                                     "fla.ops.cp.build_cp_context(cu_seqlens, group=...).")
    if q.shape[0] != 1:
        raise UnsupportedConfigError(f"{op}: context parallelism takes packed input, B = 1 (got B = {q.shape[0]}); "
                                     "join the batch into one row with cu_seqlens.")
    if initial_state is not None or output_final_state:
        raise UnsupportedConfigError(f"{op}: context parallelism takes no initial_state and no final state "
                                     "(as FLA); leave initial_state=None and output_final_state=False.")
    return ctx.cu_seqlens


def _state_dtype(a: CoreArgs) -> torch.dtype:
    return torch.float64 if a.q.dtype == torch.float64 else torch.float32


def _tokens(a: CoreArgs, start: int, end: int, **changes) -> CoreArgs:
    """The call restricted to tokens [start, end) of its row, as one sequence, no report."""
    def cut(x):
        return None if x is None else x[:, start:end]
    return replace(a, q=cut(a.q), k=cut(a.k), v=cut(a.v), g=cut(a.g), beta=cut(a.beta), w=cut(a.w), h0=None,
                   cu_seqlens=None, state_v_first=False, report_as="", **changes)


def _zero_value_run(a: CoreArgs, backend: str):
    """(O [1, T, HV, K], M [HV, K, K]) of a one-sequence call: v = 0, h_in = I."""
    HV, K = a.v.shape[2], a.q.shape[-1]
    dt = _state_dtype(a)
    v = a.v.new_zeros(*a.v.shape[:3], K)
    w = None if a.w is None else a.w.new_ones(*a.w.shape[:3], K)
    eye = torch.eye(K, dtype=dt, device=a.q.device).expand(1, HV, K, K).contiguous()
    o, ht = delta_rule(replace(a, v=v, w=w, h0=eye), backend)
    return o, ht[0].to(dt)


def gather_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, in rank order, on x's device."""
    world = dist.get_world_size(group=group)
    # gloo gathers host tensors (ranks sharing one GPU, and the CPU tests, use it).
    send = x.cpu() if dist.get_backend(group) == "gloo" else x
    # The rank-concatenated output shape: NCCL and gloo both take it.
    out = send.new_empty(world * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, send.contiguous(), group=group)
    return out.view(world, *x.shape).to(x.device)


def _compose(summaries: torch.Tensor, ranks: list[int], V: int) -> torch.Tensor:
    """x <- M x + x_loc over the ranks in the given order, from x = 0 (summaries [W, HV, K, V + K])."""
    x = summaries.new_zeros(summaries.shape[1:3] + (V,))
    for r in ranks:
        x = summaries[r, ..., V:] @ x + summaries[r, ..., :V]
    return x


@torch.compiler.disable
def cp_delta_rule(a: CoreArgs, backend: str, ctx) -> torch.Tensor:
    """o of a context-parallel call (``a.cu_seqlens``: this rank's local bounds; ``ctx``: FLA's context)."""
    group = ctx.group
    rank = dist.get_rank(group=group)
    bounds = [int(b) for b in (ctx.cu_seqlens_cpu if ctx.cu_seqlens_cpu is not None else ctx.cu_seqlens.cpu())]
    HV, V = a.v.shape[2:]
    K, dt = a.q.shape[-1], _state_dtype(a)
    with torch.no_grad():
        # Forward summary of the last local sequence, which goes on to the next rank.
        summary = a.q.new_zeros(HV, K, V + K, dtype=dt)
        last_response = None
        if not ctx.is_last_rank:
            last = _tokens(a, bounds[-2], bounds[-1])
            summary[..., :V] = delta_rule(last, backend)[1][0].to(dt)
            last_response = _zero_value_run(last, backend)
            summary[..., V:] = last_response[1]
        # The first local sequence's response to its initial state, for the backward summary.
        response = None
        if not ctx.is_first_rank:
            one = len(bounds) == 2 and not ctx.is_last_rank      # first and last: that run is made
            response = last_response if one else _zero_value_run(_tokens(a, bounds[0], bounds[1]), backend)
        gathered = gather_ranks(summary, group)
    N = len(bounds) - 1
    h0 = a.q.new_zeros(N, HV, K, V, dtype=dt)
    if not ctx.is_first_rank:
        h0[0] = _compose(gathered, list(range(rank - ctx.pre_num_ranks, rank)), V)
    o, ht = delta_rule(replace(a, h0=h0, state_v_first=False), backend)
    return _NextRanksGradient.apply(o, ht, response, bounds[1], group, rank, ctx.is_last_rank,
                                    ctx.post_num_ranks, V)


class _NextRanksGradient(torch.autograd.Function):
    """Identity on o; its backward exchanges the backward summaries and hands the core the
    gradient of its last sequence's final state, which the following ranks' outputs give."""

    @staticmethod
    def forward(fctx, o, ht, response, first_end, group, rank, is_last_rank, post_ranks, V):
        fctx.response, fctx.first_end, fctx.group, fctx.rank = response, first_end, group, rank
        fctx.is_last_rank, fctx.post_ranks, fctx.V, fctx.state = is_last_rank, post_ranks, V, ht.shape
        fctx.state_dtype = ht.dtype
        return o.view_as(o)

    @staticmethod
    def backward(fctx, do):
        V, (_, HV, K, _) = fctx.V, fctx.state
        summary = do.new_zeros(HV, K, V + K, dtype=fctx.state_dtype)
        if fctx.response is not None:
            O, M = fctx.response
            first = do[0, :fctx.first_end].to(fctx.state_dtype)
            summary[..., :V] = torch.einsum("thk,thv->hkv", O[0].to(fctx.state_dtype), first)
            summary[..., V:] = M.transpose(-1, -2)
        gathered = gather_ranks(summary, fctx.group)
        dht = None
        if not fctx.is_last_rank:
            dht = do.new_zeros(fctx.state, dtype=fctx.state_dtype)
            dht[-1] = _compose(gathered, list(range(fctx.rank + fctx.post_ranks, fctx.rank, -1)), V)
        return do, dht, None, None, None, None, None, None, None
