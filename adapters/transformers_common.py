"""The call convention shared by transformers' delta-rule layers.

transformers resolves each model's core once at import: the modeling module
defines ``torch_chunk_gated_delta_rule`` (or ``chunk_kimi_delta_attention``)
wrapped by ``use_kernel_func_from_hub_with_fallback``, which at call time runs
FLA's op when FLA is importable and the plain-torch function otherwise. The
layer calls that module-level name as

    core(query, key, value, g=g, beta=beta, initial_state=..., output_final_state=...,
         use_qk_l2norm_in_kernel=True, [cu_seqlens=...], **forward_kwargs)

with activated gates (g already a log-decay, beta already a sigmoid) in FLA's
``[B, T, H, D]`` layout. The torch function's positional order is
``(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
use_qk_l2norm_in_kernel)``. Like transformers' wrapper (which filters keyword
arguments by the target's signature), leftover attention keyword arguments the
core has no use for (``cu_seq_lens_k``, ``max_length_q`` ...) are dropped, except that
``cu_seq_lens_q`` is the packed bounds where ``cu_seqlens`` is absent (Kimi-Linear's layer passes
them on under that name); ``cp_context``
(added by ``rewy_hf.context_parallel``) is passed on.
"""

from __future__ import annotations

from typing import Callable

from rewy_hf import ops

from ..kernels.vocabulary import names_of
from .base import Adapter

_POSITIONAL = ("g", "beta", "chunk_size", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
_PASSED_ON = ("chunk_size", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
              "cp_context")


class HFCoreCall:
    """Maps a transformers core call onto a rewy op (a class, so it pickles)."""

    def __init__(self, op: Callable):
        self.op = op

    def __call__(self, args, kwargs, *, backend, policy):
        query, key, value, *rest = args
        bound = dict(zip(_POSITIONAL, rest))
        bound.update(kwargs)
        passed = {name: bound[name] for name in _PASSED_ON if bound.get(name) is not None}
        # Kimi-Linear's layer passes the padding-free collators' bounds on under their own name.
        if "cu_seqlens" not in passed and bound.get("cu_seq_lens_q") is not None:
            passed["cu_seqlens"] = bound["cu_seq_lens_q"]
        return self.op(query, key, value, bound["g"], bound["beta"], backend=backend, policy=policy, **passed)


hf_core_call = HFCoreCall


def torch_reference(module, attr: str) -> Callable:
    """The plain-torch core behind a transformers site (skipping FLA)."""
    fn = getattr(module, attr)
    return plain_torch(getattr(fn, "original", fn))          # under a rewy CoreDispatcher


def hub_function(fn: Callable) -> Callable:
    """The function behind a Hugging Face ``kernels`` function module; ``fn`` itself for anything else.

    With ``kernels`` installed (a dependency of transformers from 5.25), ``use_kernel_forward_from_hub``
    turns each decorated modeling function into an ``nn.Module`` instance whose ``forward`` calls the
    function it was made from (unless ``kernelize`` swapped in a hub kernel), so the kernel-or-fallback
    wrapper sits one level further in."""
    if getattr(fn, "kernel_layer_name", None) is None or not callable(getattr(type(fn), "forward", None)):
        return fn
    import inspect

    try:
        inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return fn
    return inner if callable(inner) else fn


def is_hub_function(fn: Callable) -> bool:
    """Whether ``fn`` is a ``kernels`` function module (see ``hub_function``)."""
    return hub_function(fn) is not fn


def plain_torch(fn: Callable) -> Callable:
    """The torch function behind transformers' kernel-or-fallback wrapper (itself if unwrapped)."""
    fn = hub_function(fn)
    return getattr(fn, "__wrapped__", fn)


def runs_torch_fallback(fn: Callable) -> bool:
    """Whether ``fn`` is transformers' kernel-or-fallback wrapper that found no kernel package at
    import, and so runs the plain-torch function it wraps. False for anything else (a hub kernel,
    the package's kernel, a function of the user's), which is then left to run as it is."""
    import inspect

    fn = hub_function(fn)
    if not hasattr(fn, "__wrapped__"):
        return False
    try:
        return inspect.getclosurevars(fn).nonlocals.get("is_new_implementation") is False
    except (TypeError, ValueError):
        return False


def hf_adapters(models: tuple[tuple[str, str], ...], family: str, site_attr: str, decode_attr: str,
                conv_attr: str = "causal_conv1d_fn") -> tuple[Adapter, ...]:
    """One adapter per (model folder, layer class) pair whose modeling module
    defines the core ``site_attr``, the decode-step core ``decode_attr`` and the short
    convolution ``conv_attr``; its calls run the public op of the delta-rule ``family``."""
    names = names_of(family)
    rewy_op = getattr(ops, names.public)
    return tuple(
        Adapter(
            source=model,
            op=names.report,
            layer_classes=(f"transformers.models.{model}.modeling_{model}.{cls}",),
            site=f"transformers.models.{model}.modeling_{model}:{site_attr}",
            call=hf_core_call(rewy_op),
            decode_site=f"transformers.models.{model}.modeling_{model}:{decode_attr}",
            conv_site=f"transformers.models.{model}.modeling_{model}:{conv_attr}",
            bounds_kwarg="cu_seq_lens_q",
        )
        for model, cls in models
    )
