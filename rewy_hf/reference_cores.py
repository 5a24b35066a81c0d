"""Reference cores: what an *unpatched* model runs where its original core can't.

On CPU with FLA installed, transformers' delta-rule core dispatches to FLA's
Triton op and crashes, and FLA-hub layers' cores are Triton-only. To compare a
patched model with its unpatched self there, ``use_reference_cores(model)``
temporarily points every core site the model uses at a reference:
transformers' own plain-torch function (the one its hub wrapper falls back
to), or, for FLA layers, rewy's float64 token-by-token recurrence behind FLA's
signature. On CUDA the originals run, so this is not needed there.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Callable

import torch
import torch.nn as nn

from .adapters import find_adapter
from .adapters.base import Adapter
from .dispatch import CoreDispatcher
from .kernels import reference

# FLA keyword arguments that change nothing about the math.
_PLUMBING = ("cu_seqlens_cpu", "chunk_size", "chunk_indices", "disable_recompute", "cp_context",
             "return_intermediate_states", "use_graph", "max_num_seqs")

_FLA_REFERENCES = {
    "delta_rule": reference.naive_delta_rule,
    "gated_delta_rule": reference.naive_gated_delta_rule,
    "kda": reference.naive_kda,
    "gdn2": reference.naive_gdn2,
}


def fla_reference(op: str) -> Callable:
    """A float64 recurrence with the FLA op's signature and FLA's output dtypes."""
    naive = _FLA_REFERENCES[op]

    def core(*args, **kwargs):
        for key in _PLUMBING:
            kwargs.pop(key, None)
        dtype = args[2].dtype if len(args) > 2 else kwargs["v"].dtype
        o, ht = naive(*args, **kwargs)
        return o.to(dtype), (None if ht is None else ht.float())

    core.__name__ = f"reference_{op}"
    return core


def reference_for(adapter: Adapter, original: Callable) -> Callable:
    if adapter.family == "fla":
        return fla_reference(adapter.op)
    return getattr(original, "__wrapped__", original)


@contextlib.contextmanager
def use_reference_cores(model: nn.Module):
    """Point each core site used by ``model`` at its reference for the block."""
    adapters = {a.site: a for a in (find_adapter(m) for m in model.modules()) if a is not None}
    restore = []
    try:
        for site, adapter in adapters.items():
            module = importlib.import_module(adapter.site_module)
            current = getattr(module, adapter.site_attr)
            if isinstance(current, CoreDispatcher):
                restore.append((current, "original", current.original))
                current.original = reference_for(adapter, current.original)
            else:
                restore.append((module, adapter.site_attr, current))
                setattr(module, adapter.site_attr, reference_for(adapter, current))
        yield
    finally:
        for obj, attr, value in reversed(restore):
            setattr(obj, attr, value)


def needs_reference_cores(model: nn.Module) -> bool:
    return not any(p.is_cuda for p in model.parameters()) or not torch.cuda.is_available()
