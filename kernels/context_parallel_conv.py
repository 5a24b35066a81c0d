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
backward, each going back to the rank it came from. The sum is rewy's
(kernels/short_conv.py), with a mask per tap at the sequence starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError
from .context_parallel import gather_ranks
from .short_conv import check_conv_inputs, conv_taps


def cp_causal_short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                         ctx) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn(x, weight, bias, activation)`` on this rank's slice of the
    packed row; x [1, C, T_local], weight [C, W]; the result in x's dtype."""
    check_conv_inputs(x, weight)
    W, T = weight.shape[-1], x.shape[-1]
    if x.shape[0] != 1:
        raise UnsupportedConfigError(f"context parallelism takes one packed row (B = 1), got B = {x.shape[0]}.")
    if ctx.group is not None and T < W - 1:
        raise UnsupportedConfigError(
            f"context parallelism needs at least {W - 1} tokens per rank for a width-{W} convolution, got {T}; "
            "use fewer ranks or longer rows.")
    # How many of the W - 1 inputs before this slice belong to its first sequence.
    borrowed = min(ctx.pre_num_conv_tokens or 0, W - 1) if ctx.group is not None else 0
    tail = x[..., T - (W - 1):] if W > 1 else x[..., :0]
    before = _PreviousTail.apply(tail, ctx.group, borrowed) if ctx.group is not None else torch.zeros_like(tail)
    keep = _keep(ctx.cu_seqlens, T, W, borrowed, x.device)
    return conv_taps(torch.cat([before, x], dim=-1), weight, bias, activation, keep)


def _keep(cu_seqlens: torch.Tensor, T: int, W: int, borrowed: int, device) -> torch.Tensor:
    """[W, T] bool: tap j of output t reads an input of t's sequence (the first sequence may reach
    ``borrowed`` inputs back into the rank before). Built on the device, no host read."""
    t = torch.arange(T, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    start = cu[torch.searchsorted(cu[1:], t, right=True)]
    start = torch.where(start == 0, -borrowed, start)
    source = t[None, :] - (W - 1) + torch.arange(W, device=device)[:, None]
    return source >= start[None, :]


class _PreviousTail(torch.autograd.Function):
    """The previous rank's last W - 1 inputs, of which the last ``borrowed`` are kept (zeros on
    the first rank); the backward sends their gradients back to that rank."""

    @staticmethod
    def forward(fctx, tail, group, borrowed: int):
        fctx.group, fctx.borrowed = group, borrowed
        rank = dist.get_rank(group)
        gathered = gather_ranks(tail, group)[:, 0]       # [world, C, W - 1]
        before = gathered[rank - 1:rank].clone() if rank > 0 else torch.zeros_like(tail)
        return _last(before, borrowed)

    @staticmethod
    def backward(fctx, grad):
        group = fctx.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        gathered = gather_ranks(_last(grad, fctx.borrowed), group)[:, 0]
        mine = gathered[rank + 1:rank + 2].clone() if rank + 1 < world else torch.zeros_like(grad)
        return mine, None, None


def _last(x: torch.Tensor, n: int) -> torch.Tensor:
    """x with all but its last n positions zeroed."""
    if n == x.shape[-1]:
        return x
    return torch.cat([torch.zeros_like(x[..., :x.shape[-1] - n]), x[..., x.shape[-1] - n:]], dim=-1)
