"""The attention layers of a transformers hybrid inside ``rewy_hf.context_parallel``.

Each rank holds a contiguous slice of one packed row. An attention query needs the keys and values
of every earlier token of its own sequence, and a sequence may start on an earlier rank, so each
layer all-gathers its keys and values along the sequence (``torch.distributed.nn.functional
.all_gather``, whose backward returns every rank its share of the key and value gradients) and
runs SDPA once per sequence that overlaps the rank's slice: that sequence's local queries against
its keys from the sequence start up to the slice end, causal with the diagonal at the bottom
right (``torch.nn.attention.bias.causal_lower_right``: the local queries are the last of those
keys). This is the all-gather form of context parallelism that PyTorch's own ``context_parallel``
uses for flex attention; its SDPA form (a ring) runs only on CUDA and shards in its own
load-balanced order, not FLA's contiguous slices.

The layers reach this through transformers' attention interface: inside the block their config's
``_attn_implementation`` names :data:`NAME`. Positions are the caller's: pass ``position_ids``
(each token's place in its own sequence, not in the slice), so that rotary embeddings on every
rank see the positions one process would.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedConfigError

NAME = "rewy_context_parallel"


class RowAttention:
    """Where this rank's slice sits in the packed row: ``bounds`` are the row's sequence starts and
    ends (``cu_seqlens``, global), the slice is ``[rank P, (rank + 1) P)`` with P = row / world."""

    def __init__(self, bounds: torch.Tensor, group):
        import torch.distributed as dist

        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.bounds = [int(x) for x in bounds.cpu().tolist()]
        total = self.bounds[-1]
        if total % self.world:
            raise UnsupportedConfigError(f"context_parallel: the row's {total} tokens do not split evenly over "
                                         f"{self.world} ranks; pad the row to a multiple of {self.world}")
        self.part = total // self.world
        self.lo, self.hi = self.rank * self.part, (self.rank + 1) * self.part
        # The sequences overlapping this slice: (start of its keys, first local query, end), global.
        self.pieces = [(a, max(a, self.lo), min(b, self.hi)) for a, b in zip(self.bounds[:-1], self.bounds[1:])
                       if a < self.hi and b > self.lo and b > a]

    def positions(self, device) -> torch.Tensor:
        """Each local token's place in its own sequence, [1, P]: the ``position_ids`` to pass."""
        return torch.cat([torch.arange(q - a, e - a) for a, q, e in self.pieces]).to(device)[None]

    def attend(self, query, key, value, dropout: float, scaling: float | None) -> torch.Tensor:
        """query [1, H, P, D], key / value [1, Hkv, P, D*] of this slice -> [1, P, H, Dv]."""
        from torch.distributed.nn.functional import all_gather
        from torch.nn.attention.bias import causal_lower_right

        if query.shape[0] != 1 or query.shape[2] != self.part:
            raise UnsupportedConfigError(f"context_parallel attention: expected this rank's {self.part} tokens of one "
                                         f"packed row (batch 1), got queries of shape {tuple(query.shape)}")
        keys = torch.cat(all_gather(key.contiguous(), group=self.group), dim=2)
        values = torch.cat(all_gather(value.contiguous(), group=self.group), dim=2)
        groups = query.shape[1] // keys.shape[1]
        outs = []
        for a, q, e in self.pieces:
            qs = query[:, :, q - self.lo:e - self.lo]
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
