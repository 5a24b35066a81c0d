"""``--no-progress``: no progress bar anywhere in the run.

The recipe draws one bar of its own (the training steps, ``tqdm``); the libraries it calls draw
others: transformers' ``save_pretrained`` ("Writing model shards", at every checkpoint and at
``final/``) and ``from_pretrained``, huggingface_hub's downloads, and ``datasets``' loading and
preparing. Each library keeps a process-wide switch for its bars; ``bars_off`` turns transformers'
and huggingface_hub's off for the run and puts them back as they were, and ``datasets_bars_off``
does the same for ``datasets`` around the one call that loads a dataset (the package is imported
only where the run reads one).
"""

from __future__ import annotations

import contextlib
import importlib


@contextlib.contextmanager
def bars_off(off: bool = True):
    """Within the block, transformers and huggingface_hub draw no progress bar (a no-op where ``off``
    is False). Both switches are restored on the way out, huggingface_hub's per-group ones included."""
    if not off:
        yield
        return
    from transformers.utils import logging as transformers_logging

    # The module, not the `tqdm` class that huggingface_hub.utils exports under the same name.
    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")
    transformers_on = transformers_logging.is_progress_bar_enabled()
    hub_states = dict(hub_tqdm.progress_bar_states)
    # transformers' switch turns huggingface_hub's global one off too.
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if transformers_on:
            transformers_logging.enable_progress_bar()
        hub_tqdm.progress_bar_states.clear()
        hub_tqdm.progress_bar_states.update(hub_states)


@contextlib.contextmanager
def datasets_bars_off():
    """Within the block, ``datasets`` draws no progress bar; its switch is restored on the way out."""
    import datasets

    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()
