"""``rewy_hf.enable()`` / ``rewy_hf.disable()``: patch every model created from now on.

One call at the top of a training script, before the model exists, and every
transformers / FLA model the process creates afterwards (``from_pretrained``,
``from_config``, direct construction, inside ``Trainer`` or TRL alike) is
patched as ``patch_model(model, strict=False, ...)`` would patch it, through
``model_creation``'s post_init hook. A model without delta-rule layers is left
as it is. `rewy-hf run` switches on the same mechanism around the script it runs.

One switch per process: its options are the patch options of every model it
sees, so enabling again with other options is refused rather than letting two
option sets race.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

from ..errors import UnsupportedConfigError
from ..kernels.vocabulary import BACKENDS, POLICIES
from .model_creation import ModelRecorder, ModelReport, install_post_init_hook
from .patch import FALLBACKS

RUN = "rewy-hf run"       # the owner of the switch `rewy-hf run` turns on around its script
# Held while a new model is patched and while the switch changes, so that once disable()
# returns no model is patched by it any more, whichever thread creates it.
_LOCK = threading.RLock()
_ACTIVE: Enabled | None = None


class Enabled:
    """What ``rewy_hf.enable()`` switched on: its options and the models it has patched so far.

    ``reports`` lists, in creation order, each created model that has a
    delta-rule layer with its ``PatchReport`` (outermost models only: a
    composite model's submodels are folded into it). It stays readable after
    ``disable()``. Models are held weakly.
    """

    def __init__(self, recorder: ModelRecorder, owner: str):
        self.recorder = recorder            # every model seen, also those without delta-rule layers
        self.owner = owner                  # who switched it on, for the errors
        self._remove_hook: Callable[[], None] | None = None

    @property
    def options(self) -> dict | None:
        """backend / policy / fallback, or None when models are only recorded (`rewy-hf run --core original`)."""
        return None if self.recorder.patch_options is None else dict(self.recorder.patch_options)

    @property
    def active(self) -> bool:
        return _ACTIVE is self

    @property
    def reports(self) -> list[ModelReport]:
        return self.recorder.reports()

    def unpatch(self) -> int:
        """Restore the layers this switch patched that are still alive; returns how many."""
        return self.recorder.unpatch()

    def __repr__(self) -> str:
        state = "active" if self.active else "disabled"
        return f"<rewy_hf enabled {state}: options={self.options}, {len(self.reports)} model(s) with delta-rule layers>"


def check_options(backend: str, policy: str, fallback: str) -> dict:
    """The patch options, checked now rather than at the first model created."""
    if backend not in BACKENDS:
        raise UnsupportedConfigError(f"`backend`={backend!r} is unknown; choose one of {BACKENDS}.")
    if policy not in POLICIES:
        raise UnsupportedConfigError(f"`policy`={policy!r} is unknown; choose one of {POLICIES}.")
    if fallback not in FALLBACKS:
        raise UnsupportedConfigError(f"`fallback`={fallback!r} is unknown; choose one of {FALLBACKS}.")
    return {"backend": backend, "policy": policy, "fallback": fallback}


def enable(*, backend: str = "auto", policy: str = "recompute", fallback: str = "error") -> Enabled:
    """Patch every transformers / FLA model created from now on in this process.

    The options are ``patch_model``'s. Models that already exist are not
    touched: call this before the model is created, or ``patch_model`` on it.
    Calling it again with the same options returns the same ``Enabled``;
    with other options it raises, naming the fix (``rewy_hf.disable()`` first).
    """
    options = check_options(backend, policy, fallback)
    with _LOCK:
        if _ACTIVE is not None:
            if _ACTIVE.options == options:
                return _ACTIVE
            raise UnsupportedConfigError(_already_on(_ACTIVE, options))
        return start(ModelRecorder(options))


def _already_on(active: Enabled, asked: dict) -> str:
    if active.options is None:
        return (f"models are being recorded without patching (`{RUN} --core original`); run with "
                "`--core rewy` to train through rewy, or drop the rewy_hf.enable() call.")
    diff = ", ".join(f"{k}={active.options[k]!r} (asked: {asked[k]!r})" for k in asked if asked[k] != active.options[k])
    if active.owner == RUN:
        return (f"`{RUN}` already patches every model with {diff}; pass the options to `{RUN}` "
                "(--backend, --policy, --fallback) or drop the rewy_hf.enable() call.")
    return (f"rewy_hf.enable() is already on with {diff}; call rewy_hf.disable() first to enable it with "
            "other options (models patched so far keep their options unless disable(unpatch=True)).")


def start(recorder: ModelRecorder, owner: str = "rewy_hf.enable()") -> Enabled:
    """Make ``recorder`` see every model created from now on (``enable``, and `rewy-hf run` with its own recorder)."""
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is not None:
            raise UnsupportedConfigError(f"{_ACTIVE.owner} already patches every new model in this process; "
                                         "call rewy_hf.disable() first.")
        handle = Enabled(recorder, owner)
        handle._remove_hook = install_post_init_hook(functools.partial(_model_created, handle))
        _ACTIVE = handle
        return handle


def _model_created(handle: Enabled, model) -> None:
    with _LOCK:
        if _ACTIVE is handle:
            handle.recorder(model)


def stop(handle: Enabled, *, unpatch: bool = False) -> int:
    """Stop ``handle`` seeing new models (if it still does); with ``unpatch``, restore the layers it patched."""
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is handle:
            _ACTIVE = None
            handle._remove_hook()
        return handle.unpatch() if unpatch else 0


def disable(*, unpatch: bool = False) -> int:
    """Stop patching new models. Models already patched stay patched (they keep training through
    rewy) unless ``unpatch=True``, which restores every layer this ``enable()`` patched that is
    still alive. Returns the number of layers restored; with nothing enabled, does nothing."""
    with _LOCK:
        return 0 if _ACTIVE is None else stop(_ACTIVE, unpatch=unpatch)
