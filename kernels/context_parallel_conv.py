"""The short causal convolution of a transformers delta-rule layer under context parallelism.

Each rank holds a contiguous slice of one packed row (FLA's ``cp_context``,
contiguous layout). Output t of a width-W convolution reads inputs t - W + 1 ..
t of its own sequence, so a rank whose first sequence began on an earlier rank
needs the last W - 1 inputs of the rank before it (all of the same sequence
when the slices are at least W - 1 long), and sequences that begin inside the
slice must not reach into the one before. FLA's own convolution does this for
its layers (``causal_conv1d(..., cp_context=)``); transformers' layers call
``causal_conv1d_fn`` on ``[B, C, T]`` inputs without a context, and this is
that call with the exchange: every rank's last W - 1 inputs are all-gathered
once in the forward, and the gradients of the borrowed inputs once in the
backward, each going back to the rank it came from (the custom ops
``rewy::cp_previous_tail`` and ``rewy::cp_next_tail_grad``, which a compiled
graph keeps as single nodes). The sum is rewy's (kernels/short_conv.py), with a
mask per tap at the sequence starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import UnsupportedConfigError
from .context_parallel_call import PRE_CONV_TOKENS, CPCall, check_slice, gather_ranks, process_group
from .short_conv import check_conv_inputs, conv_taps, sequence_keep


def cp_causal_short_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                         call: CPCall) -> Tensor:
    """transformers' ``causal_conv1d_fn(x, weight, bias, activation)`` on this rank's slice of the
    packed row; x [1, C, T_local], weight [C, W]; the result in x's dtype."""
    check_conv_inputs(x, weight)
    W, T = weight.shape[-1], x.shape[-1]
    if x.shape[0] != 1:
        raise UnsupportedConfigError(f"context parallelism takes one packed row (B = 1), got B = {x.shape[0]}.")
    if not torch.compiler.is_compiling():
        # The host read would break a compiled graph; there the core's exchange refuses the length.
        check_slice(call.bounds, T)
    if T < W - 1:
        raise UnsupportedConfigError(
            f"context parallelism needs at least {W - 1} tokens per rank for a width-{W} convolution, got {T}; "
            "use fewer ranks or longer rows.")
    tail = x[..., T - (W - 1):] if W > 1 else x[..., :0]
    before = torch.ops.rewy.cp_previous_tail(tail.contiguous(), call.meta, call.group_name)
    # How many of the W - 1 inputs before this slice belong to its first sequence.
    borrowed = call.pre_conv_tokens.clamp(max=W - 1)
    keep = sequence_keep(call.cu_seqlens, T, W, x.device, borrowed)
    return conv_taps(torch.cat([before, x], dim=-1), weight, bias, activation, keep)


def _borrowed(meta: Tensor, width: int) -> int:
    return min(int(meta[PRE_CONV_TOKENS]), width)


@torch.library.custom_op("rewy::cp_previous_tail", mutates_args=())
def _previous_tail(tail: Tensor, meta: Tensor, group_name: str) -> Tensor:
    """The previous rank's last W - 1 inputs [1, C, W - 1], of which the last ``borrowed`` are kept
    (zeros on the first rank)."""
    group = process_group(group_name)
    rank = dist.get_rank(group)
    gathered = gather_ranks(tail, group)[:, 0]       # [world, C, W - 1]
    before = gathered[rank - 1:rank].clone() if rank > 0 else torch.zeros_like(tail)
    return _last(before, _borrowed(meta, tail.shape[-1]))


@_previous_tail.register_fake
def _previous_tail_fake(tail, meta, group_name):
    return torch.empty_like(tail)


@torch.library.custom_op("rewy::cp_next_tail_grad", mutates_args=())
def _next_tail_grad(grad: Tensor, meta: Tensor, group_name: str) -> Tensor:
    """The gradient of this rank's last W - 1 inputs through the next rank's convolution."""
    group = process_group(group_name)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered = gather_ranks(_last(grad, _borrowed(meta, grad.shape[-1])), group)[:, 0]
    return gathered[rank + 1:rank + 2].clone() if rank + 1 < world else torch.zeros_like(grad)


@_next_tail_grad.register_fake
def _next_tail_grad_fake(grad, meta, group_name):
    return torch.empty_like(grad)


def _setup_tail(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.group_name = inputs[2]


def _tail_backward(ctx, grad):
    (meta,) = ctx.saved_tensors
    return torch.ops.rewy.cp_next_tail_grad(grad.contiguous(), meta, ctx.group_name), None, None


_previous_tail.register_autograd(_tail_backward, setup_context=_setup_tail)


def _last(x: Tensor, n: int) -> Tensor:
    """x with all but its last n positions zeroed (a new tensor)."""
    if n == x.shape[-1]:
        return x.clone()
    return torch.cat([torch.zeros_like(x[..., :x.shape[-1] - n]), x[..., x.shape[-1] - n:]], dim=-1)
