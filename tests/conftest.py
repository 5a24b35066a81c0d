"""Shared pytest setup.

Without a GPU, Triton kernels run under its interpreter (switched on here,
before any test imports FLA; see rewy_hf/cpu_triton.py). FLA's "Triton is not
supported" import warning says nothing about our code and is silenced.
"""

import os
import warnings

import pytest
import torch

from rewy_hf.cpu_triton import enable_cpu_interpreter

HAS_CUDA = torch.cuda.is_available()
enable_cpu_interpreter()

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
