"""A patched FLA model run context-parallel: ``with context_parallel(model, cp_context): model(...)``.

FLA 0.6.0 has context parallelism in its ops (``cp_context``) and in its short
convolution, but its layers do not pass a context to either. Inside this block
every patched delta-rule layer of ``model`` does: its core call reaches rewy's
op with ``cp_context`` (kernels/context_parallel.py), and FLA's short
convolution gets it too, so each rank's first ``W - 1`` convolution inputs come
from the previous rank (FLA's own exchange). Everything else in these models
is per token, so a rank that feeds its slice of the packed row (with the
context's local ``cu_seqlens``) computes its slice of the whole row's outputs.

Served: ``fla.models`` models and rewy's GDN2 whose token mixers are all
delta-rule layers. Refused, with the reason: attention layers (FLA's hybrid
configs; their attention has no context parallelism here), transformers'
own delta-rule layers (their convolution does not exchange across ranks), and
layers that are not patched.
"""

from __future__ import annotations

import contextlib
import importlib

import torch.nn as nn

from ..errors import UnsupportedConfigError
from .dispatch import set_active_context
from .patch import patch_state

# FLA's module-level short-convolution names its layers call: ShortConvolution's, and the fused
# q/k/v convolution of GatedDeltaNet.
_CONV_SITES = ("fla.modules.causal_conv1d.ops", "fla.layers.gated_deltanet")


def _refusal(model: nn.Module) -> str | None:
    states = [s for s in map(patch_state, model.modules()) if s is not None]
    if not states:
        return "the model has no patched delta-rule layer; call rewy_hf.patch_model(model) first"
    for state in states:
        if state.adapter.family != "fla":
            return (f"{state.name} ({state.layer_class}) is a transformers layer: its short convolution does not "
                    "exchange across ranks; use an fla.models model or rewy's GDN2 (e.g. the gdn2-1b preset)")
    mixers = [n for n, m in model.named_modules() if n.endswith(".attn") and patch_state(m) is None]
    if mixers:
        return (f"the token mixer {mixers[0]} ({type(model.get_submodule(mixers[0])).__name__}) is not a patched "
                "delta-rule layer, and attention layers have no context parallelism here; use a config without "
                "attention layers (attn=None)")
    return None


@contextlib.contextmanager
def context_parallel(model: nn.Module, cp_context):
    """Run ``model``'s patched delta-rule layers and their short convolutions with ``cp_context``
    (FLA's, from ``fla.ops.cp.build_cp_context``) inside the block."""
    if (reason := _refusal(model)) is not None:
        raise UnsupportedConfigError(f"context_parallel: {reason}.")
    sites = [importlib.import_module(name) for name in _CONV_SITES]
    saved = [site.causal_conv1d for site in sites]

    def with_context(original):
        # FLA's convolution with the context, as its layers would pass it if they took one.
        def conv(*args, **kwargs):
            return original(*args, **{**kwargs, "cp_context": cp_context})
        return conv

    previous = set_active_context(cp_context)
    try:
        for site, original in zip(sites, saved):
            site.causal_conv1d = with_context(original)
        yield cp_context
    finally:
        for site, original in zip(sites, saved):
            site.causal_conv1d = original
        set_active_context(previous)
