"""patch_model / unpatch_model / patched: swap only the delta-rule core, per instance.

For each supported layer, the module-level core name its forward calls (and,
where the adapter names them, its decode-step core and its short convolution)
is replaced (once per process) by a ``CoreDispatcher``, and a forward pre-hook
and hook on the layer instance mark it as active while its forward runs. A
transformers layer's gated output norm (and Kimi-Linear's forget gate) gets an
instance-level forward that runs it as fused work eagerly (layer_parts.py). Only marked layers reach rewy; every other
model keeps its original core. Parameters, buffers, the state dict and the
config are never touched, so checkpoints are byte-identical.

Order with PEFT and Accelerate: patch before or after ``get_peft_model`` (the
LoRA wrapping replaces Linear children, not the delta-rule layer), and before
``accelerator.prepare`` (prepare may wrap the model; patching the wrapper also
works, since it walks all submodules).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..adapters import find_adapter, looks_like_delta_rule
from ..adapters.base import Adapter, split_site
from ..errors import UnsupportedConfigError
from ..kernels.vocabulary import BACKENDS, POLICIES
from .dispatch import CoreDispatcher, active_layers, make_dispatcher, prepare_fallback_count, route
from . import flash_qla
from .layer_parts import bind_layer_parts, unbind_layer_parts
from .packing import bind_packed_rows, unbind_packed_rows
from .report import PatchedLayer, PatchReport, SkippedLayer

FALLBACKS = ("error", "original")
_STATE_ATTR = "_rewy_patch"
# Reentrant: a layer collected by the garbage collector while this thread holds the
# lock runs _restore_site_if_unused (below) inside the critical section.
_SITES_LOCK = threading.RLock()
# Per core site, the layers currently patched for it (weakly held: a layer that
# is garbage-collected stops counting). When the last one is unpatched, or
# collected, the module-level name is restored.
_SITE_LAYERS: dict[str, weakref.WeakSet] = {}
# Layers that already carry a finalizer releasing their site (see _restore_site_if_unused).
_WATCHED: weakref.WeakSet = weakref.WeakSet()


@dataclass
class LayerPatch:
    """The per-instance patch state, stored in the layer's ``__dict__``."""

    name: str
    layer_class: str
    adapter: Adapter
    backend: str
    policy: str
    fallback: str
    hook_ids: tuple[int, int] = (-1, -1)     # the forward pre-hook and hook that mark the layer active
    parts: tuple[str, ...] = ()              # its children run in rewy's form (layer_parts.py)

    def call_core(self, original: Callable, args: tuple, kwargs: dict):
        return route(self, original, args, kwargs)


def _enter(layer: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a patched layer: mark it active for the length of its forward."""
    state: LayerPatch = layer.__dict__[_STATE_ATTR]
    # A deep copy (or any clone made without patch_model) carries the patch
    # state but was never registered; make sure its site still dispatches.
    # Checked without the lock: on every forward after the first it is a
    # dict lookup and a set membership test. Traced (torch.compile), only the site is checked:
    # dynamo would guard on the registry's size, and recompile whenever any other patched layer
    # is patched or collected; a clone's registration waits for its first eager call.
    if torch.compiler.is_compiling():
        if not _site_dispatches(state.adapter):
            _install_dispatcher(state.adapter, layer)
    else:
        registered = _SITE_LAYERS.get(state.adapter.site)
        if registered is None or layer not in registered or not _site_dispatches(state.adapter):
            _install_dispatcher(state.adapter, layer)
    active_layers().append(state)


def _leave(layer: nn.Module, args: tuple, output) -> None:
    """Forward hook of a patched layer (called also when its forward raises): unmark it."""
    stack = active_layers()
    if stack and stack[-1] is layer.__dict__.get(_STATE_ATTR):
        stack.pop()


def _add_hooks(layer: nn.Module) -> tuple[int, int]:
    """The pre-hook first (before any other), the hook always called; their ids, for unpatching.
    Hooks rather than an instance-level ``forward``: transformers' ``train()`` / ``eval()`` re-run
    ``kernelize`` on a model loaded with hub kernels, which deletes instance-level forwards of the
    layers it maps."""
    enter = layer.register_forward_pre_hook(_enter, prepend=True)
    leave = layer.register_forward_hook(_leave, always_call=True)
    return enter.id, leave.id


def _remove_hooks(layer: nn.Module, ids: tuple[int, int]) -> None:
    enter, leave = ids
    layer._forward_pre_hooks.pop(enter, None)
    layer._forward_hooks.pop(leave, None)
    layer._forward_hooks_always_called.pop(leave, None)


def _site_dispatches(adapter: Adapter) -> bool:
    for site in adapter.sites:
        module_name, attr = split_site(site)
        module = sys.modules.get(module_name)
        if module is None or not isinstance(getattr(module, attr, None), CoreDispatcher):
            return False
    return True


def _install_dispatcher(adapter: Adapter, layer: nn.Module) -> None:
    with _SITES_LOCK:
        for site in adapter.sites:
            module_name, attr = split_site(site)
            module = importlib.import_module(module_name)
            current = getattr(module, attr)
            if not isinstance(current, CoreDispatcher):
                setattr(module, attr, make_dispatcher(current, site, adapter.role(site)))
        _SITE_LAYERS.setdefault(adapter.site, weakref.WeakSet()).add(layer)
        # A patched model dropped without unpatch_model must not leave the dispatcher behind.
        # One finalizer per layer, however often it is patched and unpatched.
        if layer not in _WATCHED:
            _WATCHED.add(layer)
            weakref.finalize(layer, _restore_site_if_unused, adapter)


def _restore_site_if_unused(adapter: Adapter) -> None:
    """Restore the site's original core once no live patched layer is registered there
    (after an unpatch, and from a patched layer's finalizer when it is collected)."""
    with _SITES_LOCK:
        layers = _SITE_LAYERS.get(adapter.site)
        # Iterate rather than len(): the dying layer's entry may not be purged yet.
        if layers is not None and next(iter(layers), None) is not None:
            return
        for site in adapter.sites:
            module_name, attr = split_site(site)
            module = sys.modules.get(module_name)
            current = None if module is None else getattr(module, attr, None)
            if isinstance(current, CoreDispatcher):
                setattr(module, attr, current.original)


def _release_dispatcher(adapter: Adapter, layer: nn.Module) -> None:
    with _SITES_LOCK:
        _SITE_LAYERS.setdefault(adapter.site, weakref.WeakSet()).discard(layer)
        _restore_site_if_unused(adapter)


def _check_backend(backend: str) -> str:
    """``auto`` stays ``auto`` in the patch and its report: it is decided per call (triton on CUDA
    where rewy has Triton kernels, torch elsewhere; the dispatch report counts which one served
    each call), so a model patched on the CPU and moved to a GPU afterwards runs the Triton kernels."""
    if backend not in BACKENDS:
        raise UnsupportedConfigError(f"`backend`={backend!r} is unknown; choose one of {BACKENDS}.")
    return backend


def _layer_class(layer: nn.Module) -> str:
    return type(layer).__name__


def patch_model(
    model: nn.Module,
    *,
    backend: str = "auto",
    policy: str = "recompute",
    fallback: str = "error",
    strict: bool = True,
) -> PatchReport:
    """Route the chunked delta-rule core of every supported layer of ``model`` to rewy.

    Idempotent (a patched layer is left as it is and reported), reversible with
    ``unpatch_model``, and scoped to this instance. ``fallback="original"``
    runs the original core for calls rewy cannot serve, counting each in
    ``rewy_hf.dispatch_report()``; ``fallback="error"`` raises
    ``UnsupportedConfigError`` instead. With ``strict=True`` a model without a
    supported layer is an error; with ``strict=False`` the report is empty.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedConfigError(f"patch_model expects a torch.nn.Module (a loaded model), got "
                                     f"{type(model).__name__}; load the model first, e.g. "
                                     "AutoModelForCausalLM.from_pretrained(...).")
    if policy not in POLICIES:
        raise UnsupportedConfigError(f"`policy`={policy!r} is unknown; choose one of {POLICIES}.")
    if fallback not in FALLBACKS:
        raise UnsupportedConfigError(f"`fallback`={fallback!r} is unknown; choose one of {FALLBACKS}.")
    backend = _check_backend(backend)
    prepare_fallback_count()
    report = PatchReport(backend=backend, policy=policy, fallback=fallback)
    for name, layer in model.named_modules():
        existing = layer.__dict__.get(_STATE_ATTR)
        if existing is not None:
            _check_same_options(name, existing, backend, policy, fallback)
            report.patched.append(PatchedLayer(name, _layer_class(layer), existing.adapter.op,
                                               existing.backend, existing.policy, already=True))
            continue
        adapter = find_adapter(layer)
        if adapter is None:
            if looks_like_delta_rule(layer):
                report.skipped.append(SkippedLayer(name, _layer_class(layer), "no rewy adapter for this layer class"))
            continue
        _install_dispatcher(adapter, layer)
        state = LayerPatch(name, _layer_class(layer), adapter, backend, policy, fallback)
        layer.__dict__[_STATE_ATTR] = state
        state.hook_ids = _add_hooks(layer)
        state.parts = bind_layer_parts(layer)
        report.patched.append(PatchedLayer(name, _layer_class(layer), adapter.op, backend, policy))
    _bind_packed_rows(model)
    if strict and not report.patched:
        raise UnsupportedConfigError(
            f"no supported delta-rule layer found in {type(model).__name__}"
            + (f" ({len(report.skipped)} found but not supported: see the report with strict=False)"
               if report.skipped else "")
            + f". Supported layer classes: {', '.join(supported_layer_classes())}."
        )
    gdn = sum(1 for p in report.patched if p.op == flash_qla.GDN_OP and not p.already)
    said = flash_qla.gdn_note(gdn, backend) if gdn else None
    if said is not None:
        report.notes.append(said[0])
        if said[1]:
            warnings.warn(said[0], RuntimeWarning, stacklevel=2)
    return report


def _bind_packed_rows(model: nn.Module) -> None:
    """Let ``model`` hand its layers the document bounds of a row packed by ``position_ids`` alone
    (rewy_hf/patching/packing.py), under the keyword its patched layers read."""
    if _STATE_ATTR in model.__dict__:
        return                          # a patched layer itself: its caller holds the positions
    kwargs = {state.adapter.bounds_kwarg for m in model.modules()
              if (state := m.__dict__.get(_STATE_ATTR)) is not None}
    if len(kwargs) == 1:
        bind_packed_rows(model, kwargs.pop())


def _check_same_options(name: str, existing: LayerPatch, backend: str, policy: str, fallback: str) -> None:
    """A second patch_model with other options must not keep the first call's silently."""
    now = dict(backend=backend, policy=policy, fallback=fallback)
    before = dict(backend=existing.backend, policy=existing.policy, fallback=existing.fallback)
    if now != before:
        diff = ", ".join(f"{k}={before[k]!r} (asked: {now[k]!r})" for k in now if now[k] != before[k])
        raise UnsupportedConfigError(
            f"{name or '<root>'} is already patched with {diff}; call rewy_hf.unpatch_model(model) first to "
            "patch it with other options.")


def unpatch_model(model: nn.Module, *, only: set[str] | None = None) -> int:
    """Restore every patched layer of ``model`` (or those named in ``only``);
    returns how many were restored."""
    restored = 0
    for name, layer in model.named_modules():
        if only is not None and name not in only:
            continue
        state = layer.__dict__.pop(_STATE_ATTR, None)
        if state is None:
            continue
        _remove_hooks(layer, state.hook_ids)
        unbind_layer_parts(layer, state.parts)
        _release_dispatcher(state.adapter, layer)
        restored += 1
    if not any(_STATE_ATTR in m.__dict__ for m in model.modules()):
        unbind_packed_rows(model)
    return restored


def is_patched(layer: nn.Module) -> bool:
    return _STATE_ATTR in layer.__dict__


def patch_state(layer: nn.Module) -> LayerPatch | None:
    """The layer's patch (its name, adapter, backend, policy, fallback), or None if it is not patched."""
    return layer.__dict__.get(_STATE_ATTR)


@contextlib.contextmanager
def patched(model: nn.Module, **options: Any):
    """``with rewy_hf.patched(model): ...`` patches for the block and restores after."""
    report = patch_model(model, **options)
    try:
        yield report
    finally:
        # Layers that were patched before the block stay patched.
        unpatch_model(model, only={p.name for p in report.patched if not p.already})


def supported_layer_classes() -> list[str]:
    from ..adapters import all_adapters

    return sorted({cls.rsplit(".", 1)[1] for a in all_adapters() for cls in a.layer_classes})
