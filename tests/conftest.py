"""Shared pytest setup.

Without a GPU, Triton kernels can only run under its interpreter, which must be
switched on before any kernel is defined (i.e. before FLA is imported). FLA's
short convolution and fused norms then run on CPU, once their chunk core is
rewy's or a reference (FLA's own chunk kernels do not run in the interpreter).
The autotuner needs a GPU driver to time configs, so each autotuned kernel is
cut down to its first config. FLA's "Triton is not supported" import warning
says nothing about our code and is silenced.
"""

import os
import warnings

import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.runtime.autotuner as _autotuner

    _autotuner_init = _autotuner.Autotuner.__init__

    def _first_config_only(self, fn, arg_names, configs, *args, **kwargs):
        _autotuner_init(self, fn, arg_names, configs[:1], *args, **kwargs)

    _autotuner.Autotuner.__init__ = _first_config_only

import pytest  # noqa: E402

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
