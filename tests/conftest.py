"""Shared pytest setup.

FLA prints a UserWarning on import when no GPU driver is found; it says nothing
about our code, so it is silenced here once for the whole suite.
"""

import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
