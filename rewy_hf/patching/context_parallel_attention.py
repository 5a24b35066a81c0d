"""The attention layers of a transformers hybrid inside ``rewy_hf.context_parallel``.

Each rank holds a contiguous slice of one packed row. An attention query needs the keys and values
of every earlier token of its own sequence, and a sequence may start on an earlier rank, so each
layer all-gathers its keys and values along the sequence and runs SDPA once per sequence that
overlaps the rank's slice: that sequence's local queries against its keys from the sequence start
up to the slice end, causal with the diagonal at the bottom right
(``torch.nn.attention.bias.causal_lower_right``: the local queries are the last of those keys).
The backward gathers the keys and values again (rather than keeping every rank's copy per layer),
differentiates the same SDPA calls, and returns every rank the sum of its keys' and values'
gradients. This is the all-gather form of context parallelism that PyTorch's own
``context_parallel`` uses for flex attention; its SDPA form (a ring) runs only on CUDA and shards in
its own load-balanced order, not FLA's contiguous slices.

Forward and backward are the custom ops ``rewy::cp_row_attention`` and
``rewy::cp_row_attention_backward``: the sequence bounds are read on the host inside them, so a
compiled model keeps one graph through its attention layers and does not compile again for a new
packing of the row.

The layers reach this through transformers' attention interface: inside the block their config's
``_attn_implementation`` names :data:`NAME`. Positions are the caller's: pass ``position_ids``
(each token's place in its own sequence, not in the slice), so that rotary embeddings on every
rank see the positions one process would.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UnsupportedConfigError
from ..kernels.context_parallel_call import REDUCE_SCATTER, gather_ranks, process_group

NAME = "rewy_context_parallel"


def _pieces(bounds: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The sequences overlapping tokens [lo, hi) of the row: (start of its keys, first local query,
    end), global positions."""
    return [(a, max(a, lo), min(b, hi)) for a, b in zip(bounds[:-1], bounds[1:]) if a < hi and b > lo and b > a]


class RowAttention:
    """Where this rank's slice sits in the packed row: ``bounds`` are the row's sequence starts and
    ends (``cu_seqlens``, global), the slice is ``[rank P, (rank + 1) P)`` with P = row / world."""

    def __init__(self, bounds: torch.Tensor, group):
        self.group = group
        self.group_name = group.group_name
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.bounds = bounds.detach().to("cpu", torch.int64)
        total = int(self.bounds[-1])
        if total % self.world:
            raise UnsupportedConfigError(f"context_parallel: the row's {total} tokens do not split evenly over "
                                         f"{self.world} ranks; pad the row to a multiple of {self.world}")
        self.part = total // self.world

    def positions(self, device) -> torch.Tensor:
        """Each local token's place in its own sequence, [1, P]: the ``position_ids`` to pass."""
        lo = self.rank * self.part
        pieces = _pieces(self.bounds.tolist(), lo, lo + self.part)
        return torch.cat([torch.arange(q - a, e - a) for a, q, e in pieces]).to(device)[None]

    def attend(self, query, key, value, dropout: float, scaling: float | None) -> torch.Tensor:
        """query [1, H, P, D], key / value [1, Hkv, P, D*] of this slice -> [1, P, H, Dv]."""
        if query.shape[0] != 1 or query.shape[2] != self.part:
            raise UnsupportedConfigError(f"context_parallel attention: expected this rank's {self.part} tokens of one "
                                         f"packed row (batch 1), got queries of shape {tuple(query.shape)}")
        # Dropout draws its mask from this seed in the forward and again in the backward's rerun.
        seed = torch.randint(0, 2 ** 62, (), dtype=torch.int64) if dropout > 0 else None
        return torch.ops.rewy.cp_row_attention(query.contiguous(), key.contiguous(), value.contiguous(), self.bounds,
                                               self.group_name, float(dropout), scaling, seed)


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
    return group, lo, _pieces(bounds.tolist(), lo, lo + part)


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


_ACTIVE: list[RowAttention] = []


def row_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                  scaling: float | None = None, **kwargs):
    """transformers' attention-interface signature; the mask is ignored (the row's bounds say it)."""
    if not _ACTIVE:
        raise UnsupportedConfigError(f"attention implementation {NAME!r} runs only inside rewy_hf.context_parallel "
                                     "(with the row's cu_seqlens)")
    return _ACTIVE[-1].attend(query, key, value, dropout, scaling), None


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The attention modules of a transformers hybrid that this serves: dense causal attention
    (layer type ``full_attention``, no sliding window) that reads its attention function from the
    config. Sliding-window and indexed (sparse) attention are left out, and so refused."""
    from .patch import patch_state

    def served(m: nn.Module) -> bool:
        config = getattr(m, "config", None)
        types = getattr(config, "layer_types", None)
        idx = getattr(m, "layer_idx", None)
        return (type(m).__module__.startswith("transformers.models.") and hasattr(config, "_attn_implementation")
                and types is not None and idx is not None and types[idx] == "full_attention"
                and getattr(m, "is_causal", True) and getattr(m, "sliding_window", None) is None)

    return [m for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] == "self_attn" and patch_state(m) is None and served(m)]


@contextlib.contextmanager
def row_attention_active(layers: list[nn.Module], split: RowAttention):
    """Inside: ``layers`` attend through :func:`row_attention` with ``split``."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, row_attention)
    configs = list({id(m.config): m.config for m in layers}.values())
    saved = [c._attn_implementation for c in configs]
    _ACTIVE.append(split)
    try:
        for c in configs:
            c._attn_implementation = NAME
        yield split
    finally:
        for c, old in zip(configs, saved):
            c._attn_implementation = old
        _ACTIVE.pop()
