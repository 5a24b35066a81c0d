"""Packed rows described only by ``position_ids``: their document bounds, handed to the layers.

Padding-free collators (transformers' ``DataCollatorWithFlattening``, TRL's
padding-free mode) put many documents in one row and mark them with
``position_ids`` that restart at every document; on request they add the
flash-attention arguments ``cu_seq_lens_q`` / ``cu_seq_lens_k`` /
``max_length_q`` / ``max_length_k`` as well. transformers' attention layers
keep documents apart with either (their masks follow restarting
``position_ids``), but its delta-rule layers see only the bounds: their
decoder layers do not pass ``position_ids`` on. Given ``position_ids`` alone,
each document's recurrence and short convolution would run on from the one
before.

So a forward pre-hook on a patched model derives the bounds from
``position_ids`` where the caller gave none, and passes them down under the
keyword its layers read (``Adapter.bounds_kwarg``): the same call the collator
makes with ``return_flash_attn_kwargs=True``. A packed forward also runs
without a cache: these models make one in a training forward by default, and
with one transformers' attention masks stop following the document bounds. A
caller who asks for a cache (``use_cache=True``, a prefill) gets the row as
given if it holds one document, and a refusal if it holds several. The
bounds travel as a forward argument, not as process state, so a layer
recomputed under gradient checkpointing sees them again.

A row of one document gets the bounds ``[0, T]``: every row of a packed run
then takes the same kernels. Deriving bounds reads tensor values: one host
synchronisation per forward of one row given ``position_ids`` (eagerly, rows
of B > 1 are read too, only to refuse restarts inside them). Under
``torch.compile`` the derivation runs outside the graph (one graph break at
the model's entry, none inside a layer; none at all for a call without
``position_ids`` or with B > 1), and the bounds enter the graph with a dynamic
length, so a new number of documents does not recompile.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn as nn

from ..errors import UnsupportedConfigError
from .dispatch import active_context, packed_bounds

PACKING_ATTR = "_rewy_packing"
_CACHES = ("past_key_values", "cache", "cache_params")


def bounds_from_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``cu_seqlens`` (int32, ``[0, ..., T]``) of the documents in a row [1, T] whose
    ``position_ids`` restart at each one (any restart: a position that is not the previous one plus
    one); ``[0, T]`` for a row of one document, so that every row of a packed run takes the same
    kernels (a row that happens to hold one long document would otherwise compile and tune the
    unpacked kernels in the middle of the run). None for rows of B > 1 that do not restart; those
    that do are refused: the padding-free collators build one row, and transformers' flash
    attention also reads packing from ``position_ids`` only for B = 1."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return None
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if position_ids.shape[0] > 1:
        if bool(restarts.any()):
            raise UnsupportedConfigError(
                f"position_ids restart inside rows of a batch of {position_ids.shape[0]} rows: rewy keeps packed "
                "documents apart in one packed row (B = 1), as DataCollatorWithFlattening and TRL's padding-free "
                "collator build it. Flatten the batch into one row, or pass the bounds as cu_seq_lens_q.")
        return None
    inner = restarts[0].nonzero().squeeze(1).to(torch.int32) + 1
    T = position_ids.shape[1]
    edge = inner.new_tensor
    cu = torch.cat([edge([0]), inner, edge([T])])
    # Dynamic from the first compiled step: the next packing's document count must not recompile.
    torch._dynamo.maybe_mark_dynamic(cu, 0)
    return cu


_derive: Callable = bounds_from_positions


def _prepare_derive() -> None:
    # Made when a model is patched, not at import: torch.compiler.disable imports dynamo (and with it
    # Triton), which importing rewy_hf must not do; nor in traced code, where the call breaks the graph.
    global _derive
    if _derive is bounds_from_positions:
        _derive = torch.compiler.disable(bounds_from_positions)


class RowPacking:
    """What the hook needs: the keyword the layers read, where ``position_ids`` sits among the
    positional arguments, and whether the forward takes ``use_cache``."""

    def __init__(self, kwarg: str, position_index: int | None, takes_use_cache: bool):
        self.kwarg = kwarg
        self.position_index = position_index
        self.takes_use_cache = takes_use_cache


def _packed_rows_hook(model: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a patched model: adds the document bounds of a row packed by
    ``position_ids`` alone. A hook, not an instance-level ``forward``: Liger-Kernel and accelerate
    replace the instance's forward, before or after rewy, and a hook runs before whichever it is."""
    state: RowPacking | None = model.__dict__.get(PACKING_ATTR)
    if state is None or any(kwargs.get(k) is not None for k in _CACHES) or active_context() is not None:
        # decoding (a cache continues its own rows), or context parallelism (the context holds the
        # row's bounds; each rank's positions are those of its slice)
        return None
    given = packed_bounds(kwargs)
    packed = given is not None
    if state.kwarg == "cu_seqlens" and kwargs.get("cu_seqlens") is None and packed:
        # The collators' flash-attention bounds, for FLA's layers, which read only ``cu_seqlens``.
        kwargs["cu_seqlens"] = given
    if not packed:
        positions = kwargs.get("position_ids")
        if positions is None and state.position_index is not None and len(args) > state.position_index:
            positions = args[state.position_index]
        bounds = None
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            if kwargs.get("use_cache"):
                # A cache asked for (a prefill): the row as the caller gave it, unless it packs several
                # documents, which is refused below.
                several = bounds_from_positions(positions)
                packed = several is not None and several.numel() > 2
            elif positions.shape[0] == 1:
                # Read on the host (outside the graph under torch.compile).
                bounds = _derive(positions)
            elif not torch.compiler.is_compiling():
                bounds_from_positions(positions)    # only to refuse restarts in rows of B > 1
        if bounds is not None:
            kwargs[state.kwarg] = bounds
            packed = True
    if packed and state.takes_use_cache:
        if kwargs.get("use_cache"):
            raise UnsupportedConfigError(
                "use_cache=True on a packed row (several documents in one row): a cache holds one state "
                "per row and cannot continue several documents, and transformers' attention masks ignore "
                "the document bounds once a cache is made. Pass use_cache=False for training, or generate "
                "one document per row.")
        # A training forward of these models makes a cache unless told not to (config.use_cache).
        kwargs["use_cache"] = False
    return args, kwargs


def bind_packed_rows(model: nn.Module, kwarg: str) -> bool:
    """Register the packed-rows hook on ``model`` (once) where its forward takes ``position_ids``
    and can pass ``kwarg`` on; returns whether the model carries it."""
    if PACKING_ATTR in model.__dict__:
        return True
    _prepare_derive()
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # FLA's models take position_ids (and the bounds) through **kwargs.
    if not takes_kwargs and not ("position_ids" in params and kwarg in params):
        return False
    positional = [n for n, p in params.items()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    index = positional.index("position_ids") if "position_ids" in positional else None
    model.__dict__[PACKING_ATTR] = RowPacking(kwarg, index, "use_cache" in params or takes_kwargs)
    model.register_forward_pre_hook(_packed_rows_hook, with_kwargs=True)
    return True


def unbind_packed_rows(model: nn.Module) -> None:
    if model.__dict__.pop(PACKING_ATTR, None) is None:
        return
    # Found by identity, not by a stored handle: a deep-copied or unpickled model has the hook
    # under the same id in its own dictionaries, which a handle of the original does not reach.
    for hook_id, hook in list(model._forward_pre_hooks.items()):
        if hook is _packed_rows_hook:
            del model._forward_pre_hooks[hook_id]
            model._forward_pre_hooks_with_kwargs.pop(hook_id, None)
