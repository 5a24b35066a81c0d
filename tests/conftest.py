"""Shared pytest setup.

Without a GPU, Triton kernels run under its interpreter (switched on here,
before any test imports FLA; see rewy_hf/cpu_triton.py). With one, every
autotuner is cut to its first config, also before FLA is imported. FLA's "Triton is not
supported" import warning says nothing about our code and is silenced.
"""

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rewy_hf.cpu_triton import enable_cpu_interpreter, first_config_only

# Shared test helpers (tiny models, op cases, loop references) live in tests/support.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

HAS_CUDA = torch.cuda.is_available()
enable_cpu_interpreter()
if HAS_CUDA:
    # The GPU tests check values, not speed: one config per autotuned kernel (as
    # `rewy-hf verify` does) keeps a cold run's compile time to minutes.
    first_config_only()

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Tests that draw from torch's global generators get the same numbers whichever tests ran before
    them (a `-k` selection otherwise changes a GPU test's random gradients, and so its errors)."""
    torch.manual_seed(0)
