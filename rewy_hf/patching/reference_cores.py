"""Reference cores: what an *unpatched* model runs where its original core can't.

FLA-hub layers' cores are Triton-only, so on CPU they cannot run unpatched.
transformers' layers can: with transformers 5.25 their hub wrapper falls back
to its plain-torch core on CPU tensors, FLA installed or not, and unpatched
models train and ``generate`` there. To compare a patched model with its
unpatched self on CPU, ``use_reference_cores(model)`` temporarily points every
core site the model uses at a reference: for transformers' layers that same
plain-torch function (so every unpatched core of a comparison has one
definition, whatever the wrapper would pick), for FLA layers rewy's float64
token-by-token recurrence behind FLA's signature. On CUDA the originals run,
so this is not needed there.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Callable

import torch
import torch.nn as nn

from ..adapters import find_adapter
from ..adapters.base import Adapter
from ..adapters.transformers_common import plain_torch
from ..kernels import reference
from ..kernels.vocabulary import family_of_report
from .dispatch import CoreDispatcher

# FLA keyword arguments that change nothing about the math.
_PLUMBING = ("cu_seqlens_cpu", "chunk_size", "chunk_indices", "disable_recompute", "cp_context",
             "return_intermediate_states", "use_graph", "max_num_seqs")

# Per delta-rule family.
_FLA_REFERENCES = {
    "delta_rule": reference.naive_delta_rule,
    "gdn": reference.naive_gated_delta_rule,
    "kda": reference.naive_kda,
    "gdn2": reference.naive_gdn2,
}


def fla_reference(op: str) -> Callable:
    """A float64 recurrence with the FLA op's signature and FLA's output dtypes; ``op`` is the op's
    report name (an adapter's ``op``: ``gated_delta_rule``, ...)."""
    naive = _FLA_REFERENCES[family_of_report(op)]

    def core(*args, **kwargs):
        for key in _PLUMBING:
            kwargs.pop(key, None)
        dtype = args[2].dtype if len(args) > 2 else kwargs["v"].dtype
        o, ht = naive(*args, **kwargs)
        return o.to(dtype), (None if ht is None else ht.float())

    core.__name__ = f"reference_{op}"
    return core


def reference_for(adapter: Adapter, original: Callable) -> Callable:
    if adapter.source == "fla":
        return fla_reference(adapter.op)
    return plain_torch(original)


@contextlib.contextmanager
def replaced_core(module, attr: str, core: Callable):
    """Make ``core`` what an *unpatched* layer reaches through ``module.attr``.

    Without a rewy dispatcher the module-level name is set; under one, the
    dispatcher's ``original`` is, so patched instances keep routing to rewy.
    On exit the saved original is put back wherever the site then stands,
    also when a patch or unpatch happened inside the block.
    """
    current = getattr(module, attr)
    saved = current.original if isinstance(current, CoreDispatcher) else current

    def install(fn: Callable) -> None:
        now = getattr(module, attr)
        if isinstance(now, CoreDispatcher):
            now.original = fn
        else:
            setattr(module, attr, fn)

    install(core)
    try:
        yield core
    finally:
        install(saved)


@contextlib.contextmanager
def use_reference_cores(model: nn.Module):
    """Point each core site used by ``model`` at its reference for the block."""
    adapters = {a.site: a for a in (find_adapter(m) for m in model.modules()) if a is not None}
    with contextlib.ExitStack() as stack:
        for adapter in adapters.values():
            module = importlib.import_module(adapter.site_module)
            current = getattr(module, adapter.site_attr)
            original = current.original if isinstance(current, CoreDispatcher) else current
            stack.enter_context(replaced_core(module, adapter.site_attr, reference_for(adapter, original)))
        yield


def needs_reference_cores(model: nn.Module) -> bool:
    return not any(p.is_cuda for p in model.parameters()) or not torch.cuda.is_available()
