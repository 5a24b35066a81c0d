"""Routing a layer's delta-rule core to rewy, and counting what ran.

A layer's forward calls its core through a module-level name (transformers'
``torch_chunk_gated_delta_rule``, FLA's ``chunk_gated_delta_rule`` imported
into ``fla.layers.gated_deltanet``, ...). That name is shared by every model
in the process, so it is replaced once by a ``CoreDispatcher`` that calls
rewy only while a *patched instance* is inside its forward (a context variable
set by the wrapper bound into that instance) and the saved original
otherwise. Every routed call, optimized backward and fallback is counted in a
process-wide, JSON-serializable dispatch report.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import threading
from collections import defaultdict
from typing import Any, Callable

import torch

from .. import ops
from ..errors import UnsupportedConfigError
from .fault import apply_grad_fault

# The patch state of the layer whose forward is running, or None.
ACTIVE_LAYER: contextvars.ContextVar = contextvars.ContextVar("rewy_active_layer", default=None)

_LOCK = threading.Lock()
_COUNTS: dict[str, dict[str, Any]] = {}


def _entry(op: str) -> dict[str, Any]:
    if op not in _COUNTS:
        _COUNTS[op] = {"forward_calls": 0, "optimized_backward_calls": 0, "fallback_calls": 0,
                       "fallback_reasons": defaultdict(int), "backends": defaultdict(int),
                       "policies": defaultdict(int)}
    return _COUNTS[op]


def count_forward(op: str, backend: str, policy: str) -> None:
    with _LOCK:
        e = _entry(op)
        e["forward_calls"] += 1
        e["backends"][backend] += 1
        e["policies"][policy] += 1


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
    to the original core (with reasons), and the backends/policies used.
    A plain dict of ints and strings, ready for ``json.dump``."""
    with _LOCK:
        out = copy.deepcopy(_COUNTS)
    for e in out.values():
        for key in ("fallback_reasons", "backends", "policies"):
            e[key] = dict(e[key])
    return {"ops": out}


def reset_dispatch_report() -> None:
    with _LOCK:
        _COUNTS.clear()


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

    def __init__(self, original: Callable, site: str):
        self.original = original
        self.site = site
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        state = ACTIVE_LAYER.get()
        if state is None or state.adapter.site != self.site:
            return self.original(*args, **kwargs)
        return state.call_core(self.original, args, kwargs)

    def __repr__(self) -> str:
        return f"<rewy CoreDispatcher for {self.site} wrapping {self.original!r}>"


def count_backward_when_used(out: torch.Tensor, op: str) -> None:
    """Counts one optimized backward when the gradient of ``out`` is computed."""
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(lambda grad: (count_backward(op), grad)[1])


def route(state, original: Callable, args: tuple, kwargs: dict):
    """Run the rewy core for one call of a patched layer, honouring its fallback."""
    op = state.adapter.op
    try:
        o, final_state = state.adapter.call(args, kwargs, backend=state.backend, policy=state.policy)
    except UnsupportedConfigError as exc:
        if state.fallback == "error":
            raise UnsupportedConfigError(
                f"{state.name} ({state.layer_class}): {exc} Pass fallback='original' to patch_model to run "
                "the original core for such calls instead (they are counted in rewy_hf.dispatch_report())."
            ) from exc
        count_fallback(op, str(exc))
        return original(*args, **kwargs)
    count_forward(op, ops.last_backend.get() or state.backend, state.policy)
    count_backward_when_used(o, op)
    apply_grad_fault(o, op)
    return o, final_state
