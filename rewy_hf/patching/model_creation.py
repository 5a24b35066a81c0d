"""Patching every model as it is created, for ``rewy_hf.enable`` and `rewy-hf run`.

``PreTrainedModel.post_init`` -- which every transformers model (and every
``fla.models`` model, which subclass ``PreTrainedModel``) calls at the end of
its ``__init__`` -- is wrapped so that a callback sees each new model as soon
as it exists; ``ModelRecorder`` is that callback, patching each model with
``patch_model(model, strict=False, ...)`` (or only recording it).

A model loaded with ``from_pretrained`` is handed to the callback when
``from_pretrained`` returns instead, as if ``patch_model`` were called on the
loaded model: loading goes on after ``__init__`` (weights, device placement,
and with Hugging Face's ``kernels`` package, ``kernelize``, which drops a
layer's instance-level ``forward`` and with it the patch).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from .patch import patch_model, patch_state, unpatch_model
from .report import PatchReport

HOOK_MARK = "_rewy_run_hook"     # set on the wrapper, so a hooked post_init can be recognised


def install_post_init_hook(callback: Callable[[Any], None]) -> Callable[[], None]:
    """Wrap ``transformers.PreTrainedModel.post_init`` (and ``from_pretrained``) so that
    ``callback(model)`` sees each new model; returns the function that takes the wrappers out again."""
    from transformers import PreTrainedModel

    live = [True]
    loading = threading.local()      # how deep this thread is in from_pretrained calls

    def depth() -> int:
        return getattr(loading, "depth", 0)

    original_post_init = PreTrainedModel.post_init

    @functools.wraps(original_post_init)
    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        if live[0] and not depth():
            callback(self)
        return result

    setattr(post_init, HOOK_MARK, True)
    restore = [_wrap(PreTrainedModel, "post_init", post_init)]

    loader = PreTrainedModel.__dict__.get("from_pretrained")
    # Another library may have replaced it by something other than a classmethod; its models
    # are then patched in post_init like any other.
    if isinstance(loader, classmethod):
        original_load = loader.__func__

        @functools.wraps(original_load)
        def from_pretrained(cls, *args, **kwargs):
            loading.depth = depth() + 1
            try:
                result = original_load(cls, *args, **kwargs)
            finally:
                loading.depth -= 1
            model = result[0] if isinstance(result, tuple) else result      # output_loading_info=True
            if live[0] and not depth() and isinstance(model, nn.Module):
                callback(model)
            return result

        restore.append(_wrap(PreTrainedModel, "from_pretrained", classmethod(from_pretrained)))

    def remove() -> None:
        live[0] = False
        for put_back in restore:
            put_back()

    return remove


def _wrap(cls: type, name: str, wrapper) -> Callable[[], None]:
    """Set ``cls.name`` to ``wrapper``; returns the function that puts the previous one back."""
    missing = object()
    saved = cls.__dict__.get(name, missing)
    setattr(cls, name, wrapper)

    def put_back() -> None:
        # Another library may have wrapped it on top of ours since; putting the saved one back
        # would drop its wrapper, so ours then stays in its chain, passing through.
        if cls.__dict__.get(name) is wrapper:
            if saved is missing:
                with contextlib.suppress(AttributeError):
                    delattr(cls, name)
            else:
                setattr(cls, name, saved)

    return put_back


@contextlib.contextmanager
def post_init_hook(callback: Callable[[Any], None]):
    """``install_post_init_hook`` for the duration of a block; removed on exit, also on error."""
    remove = install_post_init_hook(callback)
    try:
        yield
    finally:
        remove()


@dataclass(frozen=True)
class ModelReport:
    """A created model that has delta-rule layers: its class name and what patch_model did to it."""

    model: str
    report: PatchReport

    def __str__(self) -> str:
        return f"{self.model}\n{self.report}"


class ModelRecorder:
    """The post_init callback: patches (or, with ``patch_options=None``, only records) each new model.

    A composite model calls post_init for each submodel first (depth first),
    then for itself; only outermost models are reported, and layers patched
    by this recorder are not reported as ``already`` patched by the outer call.
    Models and layers are held weakly; the reports are kept.
    """

    def __init__(self, patch_options: dict | None):
        self.patch_options = patch_options        # None: record only
        self.entries: list[dict] = []             # {"ref", "model", "report"}
        # layer -> the patch this recorder gave it: a layer unpatched and patched again by someone
        # else since carries another patch, which is not this recorder's to report or restore.
        # Both held weakly (the patch may hold the layer's previous forward, bound to the layer).
        self.our_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Models may be created in several threads at once.
        self._lock = threading.RLock()

    def __call__(self, model) -> None:
        with self._lock:
            report = None
            if self.patch_options is not None:
                report = patch_model(model, strict=False, **self.patch_options)
                for p in report.patched:
                    layer = model.get_submodule(p.name)
                    if p.already and self._ours(layer):
                        p.already = False
                    elif not p.already:
                        self.our_layers[layer] = weakref.ref(patch_state(layer))
            inner = {id(m) for m in model.modules() if m is not model}
            self.entries = [e for e in self.entries if e["ref"]() is None or id(e["ref"]()) not in inner]
            self.entries.append({"ref": weakref.ref(model), "model": type(model).__name__, "report": report})

    def models(self) -> list[str]:
        with self._lock:
            return [e["model"] for e in self.entries]

    def reports(self) -> list[ModelReport]:
        """The models with a delta-rule layer (patched, or found but not supported), in creation order."""
        with self._lock:
            return [ModelReport(e["model"], e["report"]) for e in self.entries
                    if e["report"] is not None and (e["report"].patched or e["report"].skipped)]

    def patched_models(self) -> list[dict]:
        return [{"model": r.model, **r.report.to_dict()} for r in self.reports()]

    def unpatch(self) -> int:
        """Restore the layers this recorder patched that are still alive and still carry its patch."""
        with self._lock:
            layers = [layer for layer in list(self.our_layers.keys()) if self._ours(layer)]
            self.our_layers = weakref.WeakKeyDictionary()
        return sum(unpatch_model(layer, only={""}) for layer in layers)

    def _ours(self, layer) -> bool:
        ref = self.our_layers.get(layer)
        return ref is not None and ref() is not None and patch_state(layer) is ref()
