"""The attention layers of a transformers hybrid inside ``rewy_hf.context_parallel``.

Each rank holds a contiguous slice of one packed row, and an attention query needs every earlier
key of its own sequence, which may have started on an earlier rank. Inside the block the layers'
config names :data:`NAME` as their attention implementation (transformers' attention interface),
and each call becomes rewy's custom op over the whole row (kernels/context_parallel_attention.py:
an all-gather of the keys and values along the sequence, one SDPA call per sequence overlapping
the slice, causal from the bottom right). This is the all-gather form of context parallelism that
PyTorch's own ``context_parallel`` uses for flex attention; its SDPA form (a ring) runs only on
CUDA and shards in its own load-balanced order, not FLA's contiguous slices.

Positions are the caller's: pass ``position_ids`` (each token's place in its own sequence, not in
the slice), so that rotary embeddings on every rank see the positions one process would.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedConfigError
from ..kernels import context_parallel_attention as row_ops  # registers the custom ops

NAME = "rewy_context_parallel"


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
        pieces = row_ops.sequence_pieces(self.bounds.tolist(), lo, lo + self.part)
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


_ACTIVE: list[RowAttention] = []
# The models whose attention attends over the row, innermost block last.
_OWNERS: list[nn.Module] = []
_POSITIONS_ATTR = "_rewy_row_positions"


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


def require_positions(model: nn.Module) -> None:
    """Make ``model`` refuse a call without ``position_ids`` inside its row-attention block. Without
    them a model numbers each rank's tokens from 0, and the keys gathered from earlier ranks meet
    queries at the wrong distances. A hook kept on the model for good, inert outside the block: one
    added and removed at each block would not reach a model compiled in between."""
    if _POSITIONS_ATTR in model.__dict__:
        return
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    model.__dict__[_POSITIONS_ATTR] = positional.index("position_ids") if "position_ids" in positional else None
    model.register_forward_pre_hook(_positions_given, with_kwargs=True)


def _positions_given(model: nn.Module, args: tuple, kwargs: dict):
    if not _OWNERS or _OWNERS[-1] is not model or kwargs.get("position_ids") is not None:
        return None
    index = model.__dict__.get(_POSITIONS_ATTR)
    if index is not None and len(args) > index and args[index] is not None:
        return None
    raise UnsupportedConfigError(
        f"context_parallel: {type(model).__name__} was called without position_ids, but its attention layers "
        "attend over the whole row and need each token's place in its own sequence (without them each rank "
        "numbers its slice from 0). Pass position_ids=RowAttention(cu_seqlens, group).positions(device) "
        "(rewy_hf.patching.context_parallel_attention; the row's cu_seqlens, as given to context_parallel).")


@contextlib.contextmanager
def row_attention_active(layers: list[nn.Module], split: RowAttention, owner: nn.Module | None = None):
    """Inside: ``layers`` attend through :func:`row_attention` with ``split``; ``owner`` (the model
    that holds them) refuses calls without ``position_ids`` if ``require_positions`` hooked it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, row_attention)
    configs = list({id(m.config): m.config for m in layers}.values())
    saved = [c._attn_implementation for c in configs]
    _ACTIVE.append(split)
    _OWNERS.append(owner)
    try:
        for c in configs:
            c._attn_implementation = NAME
        yield split
    finally:
        for c, old in zip(configs, saved):
            c._attn_implementation = old
        _ACTIVE.pop()
        _OWNERS.pop()
