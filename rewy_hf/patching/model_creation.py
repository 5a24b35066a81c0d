"""Patching every model as it is created, for `rewy-hf run`.

``PreTrainedModel.post_init`` -- which every transformers model (and every
``fla.models`` model, which subclass ``PreTrainedModel``) calls at the end of
its ``__init__``, including inside ``from_pretrained`` -- is wrapped for the
duration of a block so that a callback sees each new model as soon as it
exists; ``ModelRecorder`` is that callback, patching each model with
``patch_model(model, strict=False, ...)`` (or only recording it).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable

from .patch import patch_model, unpatch_model

HOOK_MARK = "_rewy_run_hook"     # set on the wrapper, so a hooked post_init can be recognised


@contextlib.contextmanager
def post_init_hook(callback: Callable[[Any], None]):
    """Wrap ``transformers.PreTrainedModel.post_init`` so that ``callback(model)``
    runs after it, for the duration of the block; restored on exit, also on error."""
    from transformers import PreTrainedModel

    missing = object()
    saved = PreTrainedModel.__dict__.get("post_init", missing)
    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        callback(self)
        return result

    setattr(post_init, HOOK_MARK, True)
    PreTrainedModel.post_init = post_init
    try:
        yield
    finally:
        if saved is missing:
            with contextlib.suppress(AttributeError):
                delattr(PreTrainedModel, "post_init")
        else:
            PreTrainedModel.post_init = saved


class ModelRecorder:
    """The post_init callback: patches (or, with ``patch_options=None``, only records) each new model.

    A composite model calls post_init for each submodel first (depth first),
    then for itself; only outermost models are reported, and layers patched
    by this run are not reported as ``already`` patched by the outer call.
    """

    def __init__(self, patch_options: dict | None):
        self.patch_options = patch_options        # None: record only
        self.entries: list[dict] = []             # {"ref", "model", "report"}
        self.our_layers: weakref.WeakSet = weakref.WeakSet()

    def __call__(self, model) -> None:
        report = None
        if self.patch_options is not None:
            report = patch_model(model, strict=False, **self.patch_options)
            for p in report.patched:
                layer = model.get_submodule(p.name)
                if p.already and layer in self.our_layers:
                    p.already = False
                elif not p.already:
                    self.our_layers.add(layer)
        inner = {id(m) for m in model.modules() if m is not model}
        self.entries = [e for e in self.entries if e["ref"]() is None or id(e["ref"]()) not in inner]
        self.entries.append({"ref": weakref.ref(model), "model": type(model).__name__, "report": report})

    def models(self) -> list[str]:
        return [e["model"] for e in self.entries]

    def patched_models(self) -> list[dict]:
        out = []
        for e in self.entries:
            if e["report"] is not None and (e["report"].patched or e["report"].skipped):
                out.append({"model": e["model"], **e["report"].to_dict()})
        return out

    def unpatch(self) -> int:
        """Restore the layers this run patched that are still alive."""
        restored = 0
        for layer in list(self.our_layers):
            restored += unpatch_model(layer, only={""})
        return restored
