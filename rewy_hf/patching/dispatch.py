"""Routing a layer's delta-rule core to rewy, and counting what ran.

A layer's forward calls its core through a module-level name (transformers'
``torch_chunk_gated_delta_rule``, FLA's ``chunk_gated_delta_rule`` imported
into ``fla.layers.gated_deltanet``, ...). That name is shared by every model
in the process, so it is replaced once by a ``CoreDispatcher`` that calls
rewy only while a *patched instance* is inside its forward (a thread-local
stack pushed by the wrapper bound into that instance) and the saved original
otherwise. Every routed call, optimized backward and fallback is counted in a
process-wide, JSON-serializable dispatch report. All of it is traceable by
torch.compile: a compiled patched layer has no graph break (docs/usage.md).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import defaultdict
from typing import Any, Callable

import torch

from .. import ops
from ..adapters.transformers_common import is_hub_function, plain_torch, runs_torch_fallback
from ..kernels.short_conv import causal_short_conv, packed_causal_short_conv, triton_short_conv
from ..kernels.core import add_listener
from ..errors import UnsupportedConfigError
from .fault import apply_grad_fault

# Per thread, the patch states of the layers whose forwards are running, innermost last. A
# thread-local list rather than a ContextVar: torch.compile traces it (dynamo replays its
# pushes and pops), so a compiled patched layer routes its core without a graph break.
class _Active(threading.local):
    def __init__(self):
        # Runs once in every thread that touches it, so the stack always exists: creating it
        # from traced code (dict.setdefault on the thread-local) would break the graph.
        self.stack: list = []


_ACTIVE = _Active()


def active_layers() -> list:
    """This thread's stack of running patched layers."""
    return _ACTIVE.stack

_LOCK = threading.Lock()
_COUNTS: dict[str, dict[str, Any]] = {}


def _entry(op: str) -> dict[str, Any]:
    if op not in _COUNTS:
        _COUNTS[op] = {"forward_calls": 0, "optimized_backward_calls": 0, "fallback_calls": 0,
                       "fallback_reasons": defaultdict(int), "backends": defaultdict(int),
                       "policies": defaultdict(int), "routes": defaultdict(int)}
    return _COUNTS[op]


def count_forward(op: str, backend: str, policy: str, why: str = "") -> None:
    with _LOCK:
        e = _entry(op)
        e["forward_calls"] += 1
        e["backends"][backend] += 1
        e["policies"][policy] += 1
        if why:
            e["routes"][f"{backend}: {why}"] += 1


def count_backward(op: str) -> None:
    with _LOCK:
        _entry(op)["optimized_backward_calls"] += 1


def count_fallback(op: str, reason: str) -> None:
    with _LOCK:
        e = _entry(op)
        e["fallback_calls"] += 1
        e["fallback_reasons"][reason] += 1


def dispatch_report() -> dict[str, Any]:
    """Per op: forward calls routed to rewy, optimized backward calls, fallbacks
    to the original core (with reasons), the backends/policies used, and where ``backend="auto"``
    weighed a peer (FlashQLA for GDN), why each call went where it went ("routes").
    A plain dict of ints and strings, ready for ``json.dump``."""
    with _LOCK:
        out = copy.deepcopy(_COUNTS)
    for e in out.values():
        for key in ("fallback_reasons", "backends", "policies", "routes"):
            e[key] = dict(e[key])
    return {"ops": out}


def reset_dispatch_report() -> None:
    with _LOCK:
        _COUNTS.clear()


# count_fallback as routed calls run it: eagerly even inside a compiled layer (a graph break, on
# fallback calls only), since traced, the count's read would become a guard on its value and
# recompile the graph at every call. Made by ``prepare_fallback_count`` when a model is patched, not
# at import: torch.compiler.disable imports dynamo, which loads Triton, and a CPU test must be able
# to switch on Triton's interpreter after importing rewy_hf.
_count_fallback_eagerly: Callable[[str, str], None] = count_fallback


def prepare_fallback_count() -> None:
    global _count_fallback_eagerly
    if _count_fallback_eagerly is count_fallback:
        _count_fallback_eagerly = torch.compiler.disable(count_fallback)


def report_difference(before: dict, after: dict) -> dict:
    """Per op, what ran between two dispatch reports (counts subtracted, zero entries left out)."""
    ops: dict[str, dict] = {}
    for op, now in after.get("ops", {}).items():
        then = before.get("ops", {}).get(op, {})
        entry: dict[str, Any] = {}
        for key, value in now.items():
            old = then.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                entry[key] = value - (old or 0)
            elif isinstance(value, dict):
                old = old or {}
                diff = {k: v - old.get(k, 0) if isinstance(v, int) else v for k, v in value.items()}
                entry[key] = {k: v for k, v in diff.items() if v}
            else:
                entry[key] = value
        if any(isinstance(v, int) and v for v in entry.values()):
            ops[op] = entry
    return {"ops": ops}


def total_calls(report: dict, key: str) -> int:
    """``key`` (e.g. ``"optimized_backward_calls"``) summed over the ops of a dispatch report."""
    return sum(int(e.get(key, 0)) for e in report.get("ops", {}).values())


class CoreDispatcher:
    """Stands in for a module-level core function; see the module docstring."""

    # Set on the per-site subclass that stands in for a ``kernels`` function module (make_dispatcher).
    _stands_in_for: type | None = None

    def __new__(cls, *args, **kwargs):
        # kernels unpickles a layer's private copy of a function module as ``type(module.<name>)()``;
        # while rewy stands in for that name, the copy must still come back as the function module.
        if not args and not kwargs and cls._stands_in_for is not None:
            return cls._stands_in_for()
        return super().__new__(cls)

    def __init__(self, original: Callable, site: str, role: str = "core"):
        self.original = original
        self.site = site
        self.role = role
        # Decided once, not per call (both look through transformers' wrappers): whether a compiled
        # patched layer's convolution may run rewy's fused form, and the decode step's CPU function.
        self.torch_fallback = role == "conv" and runs_torch_fallback(original)
        self.cpu_decode = plain_torch(original) if role == "decode" else None
        # A function module's __dict__ is its nn.Module state, not function attributes: not copied.
        functools.update_wrapper(self, original, updated=() if isinstance(original, torch.nn.Module)
                                 else functools.WRAPPER_UPDATES)

    def __call__(self, *args, **kwargs):
        stack = active_layers()
        state = stack[-1] if stack else None
        if state is None or self.site not in state.adapter.sites:
            return self.original(*args, **kwargs)
        if self.role == "decode":
            return route_decode(self.original, self.cpu_decode, args, kwargs)
        if self.role == "conv":
            return route_conv(self.original, self.torch_fallback, args, kwargs)
        return state.call_core(self.original, args, kwargs)

    def __repr__(self) -> str:
        return f"<rewy CoreDispatcher for {self.site} wrapping {self.original!r}>"


@functools.lru_cache(maxsize=None)
def _standing_in_for(module_type: type) -> type[CoreDispatcher]:
    return type(CoreDispatcher.__name__, (CoreDispatcher,), {"_stands_in_for": module_type, "__module__": __name__})


def make_dispatcher(original: Callable, site: str, role: str) -> CoreDispatcher:
    """The stand-in for ``original`` at ``site``: a CoreDispatcher, of a subclass that rebuilds
    ``original``'s type when that is a ``kernels`` function module (transformers >= 5.25)."""
    cls = _standing_in_for(type(original)) if is_hub_function(original) else CoreDispatcher
    return cls(original, site, role)


class _ReportCounter:
    """The dispatch report's listener on the core (kernels.core.CoreListener): the core announces
    each forward and backward of a routed call, eager or compiled, so the count is taken where the
    core runs, never in traced code."""

    def forward(self, op: str, backend: str, policy: str, why: str) -> None:
        count_forward(op, backend, policy, why)

    def backward(self, op: str, backend: str, policy: str, why: str) -> None:
        count_backward(op)


add_listener(_ReportCounter())


def route_decode(original: Callable, cpu_decode: Callable, args: tuple, kwargs: dict):
    """A patched layer's decode step: its own implementation, except on CPU, where transformers'
    choice may be FLA's recurrent kernel, which needs CUDA (transformers 5.24 picks it whenever FLA
    is importable); ``cpu_decode``, the plain-torch function behind transformers' wrapper, computes
    the same recurrence there."""
    query = args[0] if args else kwargs.get("query")
    if isinstance(query, torch.Tensor) and query.device.type == "cpu":
        return cpu_decode(*args, **kwargs)
    return original(*args, **kwargs)


def packed_bounds(kwargs: dict):
    """The document bounds of a packed call, however transformers spells them: ``cu_seqlens`` (FLA's
    layers, and transformers' GDN layers, which rename the next one), ``cu_seq_lens_q`` (the
    padding-free collators' flash-attention arguments, passed on by the layer), or None."""
    for name in ("cu_seqlens", "cu_seq_lens_q"):
        if (value := kwargs.get(name)) is not None:
            return value
    return None


CONV_OP = "short_conv"      # the convolution's entry in the dispatch report


def route_conv(original: Callable, torch_fallback: bool, args: tuple, kwargs: dict):
    """A patched layer's short convolution: inside ``context_parallel``, the convolution with its
    exchange across ranks (kernels/context_parallel_conv.py); eagerly on CUDA where transformers
    would run its ``F.conv1d`` fallback, and on every packed row there, FLA's convolution kernels
    (Gluon or Triton, ``triton_short_conv``) with the activation fused; on a packed row elsewhere,
    rewy's convolution restarting at every document start (transformers' own ignores the bounds);
    under torch.compile, where transformers would run its ``F.conv1d`` fallback, the same
    convolution in the form inductor fuses (kernels/short_conv.py); otherwise transformers' own
    choice (a kernel package it found)."""
    context = active_context()
    bounds = packed_bounds(kwargs)
    compiling = torch.compiler.is_compiling()
    names = ("hidden_states", "weight", "bias", "activation")
    bound = dict(zip(names, args))
    bound.update((k, kwargs[k]) for k in names if k in kwargs)
    x, weight, bias, activation = (bound.get(n) for n in names)
    on_cuda = isinstance(x, torch.Tensor) and x.is_cuda
    if context is None and bounds is None and not (torch_fallback and (compiling or on_cuda)):
        return original(*args, **kwargs)
    if context is not None:
        # Imported here: the context-parallel modules load Triton, which importing rewy_hf must not.
        from ..kernels import context_parallel_conv

        return context_parallel_conv.cp_causal_short_conv(x, weight, bias, activation, context)
    if on_cuda and not compiling:
        out, kernels = triton_short_conv(x, weight, bias, activation, bounds)
        count_forward(CONV_OP, kernels, "-", "packed row" if bounds is not None else "in place of F.conv1d")
        return out
    if bounds is not None:
        if not compiling:
            count_forward(CONV_OP, "torch", "-", "packed row")
        return packed_causal_short_conv(x, weight, bias, activation, bounds)
    return causal_short_conv(x, weight, bias, activation)


_CP = threading.local()


def active_context():
    """The ``cp_context`` every routed core call of this thread takes (``context_parallel``), or None."""
    return getattr(_CP, "context", None)


def set_active_context(context):
    """Make ``context`` the active one and return the one it replaces."""
    previous, _CP.context = active_context(), context
    return previous


def route(state, original: Callable, args: tuple, kwargs: dict):
    """Run the rewy core for one call of a patched layer, honouring its fallback."""
    op = state.adapter.op
    given = kwargs
    if (context := active_context()) is not None and kwargs.get("cp_context") is None:
        kwargs = {**kwargs, "cp_context": context}
    try:
        with ops.reporting_as(op):
            o, final_state = state.adapter.call(args, kwargs, backend=state.backend, policy=state.policy)
    except UnsupportedConfigError as exc:
        if state.fallback == "error":
            raise UnsupportedConfigError(
                f"{state.name} ({state.layer_class}): {exc} Pass fallback='original' to patch_model to run "
                "the original core for such calls instead (they are counted in rewy_hf.dispatch_report())."
            ) from exc
        _count_fallback_eagerly(op, str(exc))
        if given is not kwargs:         # the original core takes FLA's own context object
            given = {**given, "cp_context": context.fla_context}
        return original(*args, **given)
    apply_grad_fault(o, op)
    return o, final_state
