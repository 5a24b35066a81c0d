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


# FLA kernels whose programs each cover a tile of channels (BD), of heads (BH), of rows (BT) or of
# elements (B), by that tile's name.
_WIDEST_TILE = {"causal_conv1d_fwd_kernel": "BD", "causal_conv1d_bwd_kernel": "BD",
                "chunk_kda_fwd_kernel_intra_token_parallel": "BH",
                "chunk_gdn2_fwd_kernel_intra_token_parallel": "BH",
                "layer_norm_gated_fwd_kernel": "BT", "swiglu_fwd_kernel": "B", "swiglu_fwdbwd_kernel": "B"}


def _widest_tile_first():
    """An interpreted Triton program costs about the same whatever its tile's width, so FLA's short
    convolution (one program per 16 channels at its first config), KDA's and GDN2's token-parallel
    intra kernels (one per token and head), its gated norm (one per 16 rows) and its SwiGLU (one per
    512 elements) spend most of an interpreted training step in program overhead. Their widest listed
    tile (128 channels, 8 heads, 64 rows, 8192 elements) does the same arithmetic in a quarter of the
    programs or fewer; listed first, it is the one the interpreter's cut to one config keeps."""
    import triton.runtime.autotuner as autotuner

    cut = autotuner.Autotuner.__init__

    def init(self, fn, arg_names, configs, *args, **kwargs):
        tile = _WIDEST_TILE.get(getattr(fn, "__name__", None))
        if tile is not None:
            configs = sorted(configs, key=lambda c: -c.kwargs[tile])
        cut(self, fn, arg_names, configs, *args, **kwargs)

    autotuner.Autotuner.__init__ = init


if enable_cpu_interpreter():
    _widest_tile_first()
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
