"""A transformers hybrid's attention on this rank's slice of a packed row: the custom ops.

Each rank holds a contiguous slice of one packed row. An attention query needs the keys and values
of every earlier token of its own sequence, and a sequence may start on an earlier rank, so the
forward all-gathers the layer's keys and values along the sequence and runs SDPA once per sequence
that overlaps the rank's slice: that sequence's local queries against its keys from the sequence
start up to the slice end, causal with the diagonal at the bottom right
(``torch.nn.attention.bias.causal_lower_right``: the local queries are the last of those keys).
The backward gathers the keys and values again (rather than keeping every rank's copy per layer),
differentiates the same SDPA calls, and returns every rank the sum of its keys' and values'
gradients.

Both are custom ops (``rewy::cp_row_attention``, ``rewy::cp_row_attention_backward``) that read the
row's sequence bounds on the host, so a compiled model keeps one graph through its attention layers
and a new packing of the row compiles nothing new. patching/context_parallel_attention.py hands
them the layers' calls.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .context_parallel_call import REDUCE_SCATTER, gather_ranks, process_group


def sequence_pieces(bounds: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The sequences overlapping tokens [lo, hi) of the row: (start of its keys, first local query,
    end), global positions."""
    return [(a, max(a, lo), min(b, hi)) for a, b in zip(bounds[:-1], bounds[1:]) if a < hi and b > lo and b > a]


def _gather_sequence(x: Tensor, group) -> Tensor:
    """[1, heads, world P, D]: every rank's [1, heads, P, D] in rank order along the sequence."""
    return torch.cat(list(gather_ranks(x, group)), dim=2)


def _attend_pieces(query, keys, values, pieces, lo: int, dropout: float, scaling: float | None) -> Tensor:
    from torch.nn.attention.bias import causal_lower_right

    groups = query.shape[1] // keys.shape[1]
    outs = []
    for a, q, e in pieces:
        qs = query[:, :, q - lo:e - lo]
        ks, vs = keys[:, :, a:e], values[:, :, a:e]
        if q == a:      # the sequence starts in this slice: plain causal, SDPA's own GQA
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, dropout_p=dropout,
                                                       scale=scaling, enable_gqa=groups > 1))
            continue
        # It began on an earlier rank: the lower-right causal kernels take no GQA, so repeat this
        # stretch's keys and values to the query heads.
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(e - q, e - a),
                                                   dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


@contextlib.contextmanager
def _seeded(seed: Tensor | None, device: torch.device):
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(seed))
        yield


def _layout(query: Tensor, bounds: Tensor, group_name: str):
    group = process_group(group_name)
    part = query.shape[2]
    lo = dist.get_rank(group) * part
    return group, lo, sequence_pieces(bounds.tolist(), lo, lo + part)


@torch.library.custom_op("rewy::cp_row_attention", mutates_args=())
def _row_attention(query: Tensor, key: Tensor, value: Tensor, bounds: Tensor, group_name: str, dropout: float,
                   scaling: float | None, seed: Tensor | None) -> Tensor:
    group, lo, pieces = _layout(query, bounds, group_name)
    keys, values = _gather_sequence(key, group), _gather_sequence(value, group)
    with _seeded(seed, query.device):
        return _attend_pieces(query, keys, values, pieces, lo, dropout, scaling)


@_row_attention.register_fake
def _row_attention_fake(query, key, value, bounds, group_name, dropout, scaling, seed):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


@torch.library.custom_op("rewy::cp_row_attention_backward", mutates_args=())
def _row_attention_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, bounds: Tensor,
                            group_name: str, dropout: float, scaling: float | None,
                            seed: Tensor | None) -> list[Tensor]:
    group, lo, pieces = _layout(query, bounds, group_name)
    keys, values = _gather_sequence(key, group), _gather_sequence(value, group)

    def attend(q, ks, vs):
        return _attend_pieces(q, ks, vs, pieces, lo, dropout, scaling)

    # torch.func: autograd proper does not record inside a custom op's implementation.
    with _seeded(seed, query.device):
        _, pullback = torch.func.vjp(attend, query, keys, values)
        dq, dkeys, dvalues = pullback(grad)
    return [dq.contiguous(), _to_owners(dkeys, group).contiguous(), _to_owners(dvalues, group).contiguous()]


@_row_attention_backward.register_fake
def _row_attention_backward_fake(grad, query, key, value, bounds, group_name, dropout, scaling, seed):
    return [query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)]


def _to_owners(grad: Tensor, group) -> Tensor:
    """[1, heads, P, D]: the sum over ranks of the gradient of this rank's slice, from every rank's
    gradient of the whole gathered row [1, heads, world P, D]."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = grad.unflatten(2, (world, -1)).movedim(2, 0).contiguous()       # [world, 1, heads, P, D]
    if dist.get_backend(group) == "gloo":       # gloo has no reduce-scatter
        summed = parts.cpu()
        dist.all_reduce(summed, group=group)
        return summed[rank].to(grad.device)
    mine = parts.new_empty(parts.shape[1:])
    REDUCE_SCATTER(mine, parts, group=group)
    return mine


def _setup_row_attention(ctx, inputs, output):
    query, key, value, bounds, group_name, dropout, scaling, seed = inputs
    ctx.save_for_backward(query, key, value, bounds, seed)
    ctx.settings = (group_name, dropout, scaling)


def _row_attention_grad(ctx, grad):
    query, key, value, bounds, seed = ctx.saved_tensors
    group_name, dropout, scaling = ctx.settings
    dq, dk, dv = torch.ops.rewy.cp_row_attention_backward(grad.contiguous(), query, key, value, bounds, group_name,
                                                          dropout, scaling, seed)
    return dq, dk, dv, None, None, None, None, None


_row_attention.register_autograd(_row_attention_grad, setup_context=_setup_row_attention)
