"""What a context-parallel call needs, in a form a compiled graph can carry.

FLA's ``cp_context`` (``fla.ops.cp.build_cp_context``) holds the process group
and Python integers that change with the packing of each row (how many ranks
a sequence came through, how many of the previous rank's convolution inputs
belong to this rank's first sequence). Traced code that read those integers
would make dynamo guard on them and compile again for each new packing, and
code that called the collectives would break the graph. So a call takes them
as a :class:`CPCall`: the group by name and every per-row value in a tensor,
read on the host only inside rewy's custom ops (context_parallel.py,
context_parallel_conv.py, patching/context_parallel_attention.py), which
compiled graphs keep as single nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import InputValidationError, UnsupportedConfigError

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn that they are
# deprecated).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The host-side values of ``CPCall.meta``, by position.
IS_FIRST, IS_LAST, PRE_RANKS, POST_RANKS, PRE_CONV_TOKENS = range(5)


@dataclass(frozen=True)
class CPCall:
    """One rank's part of a packed row split across a process group.

    ``group_name``: the group's name (``ProcessGroup.group_name``); ``cu_seqlens``: the rank's local
    sequence bounds on the inputs' device; ``bounds``: the same bounds, int64 on the host;
    ``meta``: int64 on the host, the values indexed by ``IS_FIRST`` ... ``PRE_CONV_TOKENS``;
    ``pre_conv_tokens``: ``meta[PRE_CONV_TOKENS]`` on the device (the convolution's mask reads it there);
    ``fla_context``: FLA's context it was made from, for FLA's own convolution in eager CUDA runs."""

    group_name: str
    cu_seqlens: torch.Tensor
    bounds: torch.Tensor
    meta: torch.Tensor
    pre_conv_tokens: torch.Tensor
    fla_context: object = None


def cp_call(op: str, ctx, keep_fla_context: bool = False, checked: bool = True) -> CPCall:
    """``ctx`` (FLA's context, or a CPCall) as a CPCall, after the checks FLA makes, with their fixes;
    ``keep_fla_context`` keeps ``ctx`` on it; ``checked=False`` leaves the context's own consistency
    (``check_context``) to the caller."""
    if isinstance(ctx, CPCall):
        return ctx
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
    if ctx.group is None:
        # FLA runs such a context as a plain packed call: each rank's slice alone, from a zero state,
        # which is not the row's result.
        raise UnsupportedConfigError(
            f"{op}: cp_context has no process group (group=None), so no rank could receive the state of the "
            "sequences it continues. Build it with fla.ops.cp.build_cp_context(cu_seqlens, group=<the context-"
            "parallel process group>) (rewy_hf.build_cp_context checks its arguments first); to run the whole "
            "row in one process, pass cu_seqlens=<its bounds> instead of cp_context.")
    host = getattr(ctx, "cu_seqlens_cpu", None)
    bounds = (host if host is not None else ctx.cu_seqlens.cpu()).to(torch.int64)
    conv = getattr(ctx, "pre_num_conv_tokens", None) or 0
    meta = torch.tensor([int(bool(ctx.is_first_rank)), int(bool(ctx.is_last_rank)), int(ctx.pre_num_ranks or 0),
                         int(ctx.post_num_ranks or 0), int(conv)], dtype=torch.int64)
    if checked and not torch.compiler.is_compiling():
        check_context(op, bounds, meta)
    return CPCall(ctx.group.group_name, ctx.cu_seqlens, bounds, meta,
                  torch.tensor(conv, dtype=torch.int64, device=ctx.cu_seqlens.device),
                  ctx if keep_fla_context else None)


def context_fault(bounds: torch.Tensor, meta: torch.Tensor) -> str | None:
    """What makes one rank's context impossible for any sorted row (None if nothing): local bounds
    that do not run from 0 upwards, or a chain position that contradicts itself. FLA builds such
    contexts from bounds that decrease somewhere."""
    cu = bounds.reshape(-1).tolist()
    is_first, is_last, pre, post, conv = meta.tolist()
    if bounds.dim() != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] <= 0 or any(b < a for a, b in zip(cu, cu[1:])):
        return f"its local bounds {_short(cu)} do not run from 0 up to this rank's token count"
    # A first rank borrows no convolution inputs; the converse is left unchecked, since a context made
    # by hand may leave pre_num_conv_tokens unset.
    if bool(is_first) != (pre == 0) or bool(is_last) != (post == 0) or (is_first and conv != 0):
        return (f"its chain position contradicts itself (is_first_rank={bool(is_first)}, pre_num_ranks={pre}, "
                f"pre_num_conv_tokens={conv}, is_last_rank={bool(is_last)}, post_num_ranks={post})")
    return None


def check_context(op: str, bounds: torch.Tensor, meta: torch.Tensor) -> None:
    if (fault := context_fault(bounds, meta)) is not None:
        raise UnsupportedConfigError(
            f"{op}: cp_context cannot come from one packed row: {fault}. Build every rank's context from the "
            "same sorted bounds of the whole row (0, ..., row length, never decreasing), e.g. with "
            "rewy_hf.build_cp_context(cu_seqlens, group), which refuses bounds that are not.")


def check_slice(bounds: torch.Tensor, T: int) -> None:
    """Refuse inputs of T tokens where this rank's local bounds (on the host) say its slice."""
    part = int(bounds[-1])
    if T != part:
        whole = " (the whole row?)" if T > part and T % part == 0 else ""
        raise InputValidationError(
            f"context parallelism: this rank's inputs hold {T} tokens{whole}, but cp_context gives it a slice of "
            f"{part} tokens of the packed row. Pass each rank only its own slice, tokens [rank * {part}, "
            f"(rank + 1) * {part}) of the row, and build cp_context from the whole row's bounds.")


def _short(values: list) -> list:
    return values if len(values) < 12 else values[:12] + ["..."]


def process_group(name: str):
    """The process group a CPCall names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def gather_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, in rank order, on x's device."""
    world = dist.get_world_size(group=group)
    # gloo gathers host tensors (ranks sharing one GPU, and the CPU tests, use it).
    send = x.cpu() if dist.get_backend(group) == "gloo" else x
    # The rank-concatenated output shape: NCCL and gloo both take it.
    out = send.new_empty(world * x.shape[0], *x.shape[1:])
    _ALL_GATHER(out, send.contiguous(), group=group)
    return out.view(world, *x.shape).to(x.device)
