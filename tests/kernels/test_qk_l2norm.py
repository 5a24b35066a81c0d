"""The triton backend's q/k l2norm (kernels/triton_backend/qk_l2norm.py: FLA's fused kernels, run
inside rewy's autograd function; here under the interpreter on CPU).

It must compute the l2norm (float64 ground truth for values and gradients), be
bit-identical to FLA's own ``l2norm`` autograd function (the path it replaced,
which had passed on the H200), and keep no float32 copy of q or k for backward:
that copy, per layer, once made a patched Qwen3.5 step slower and larger.
"""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.triton_backend.qk_l2norm import normalize, normalize_backward
from rewy_hf.kernels.reference import L2NORM_EPS, l2norm
from rewy_hf.rel_error import rel_err


def _input(seed=0, shape=(2, 37, 3, 64)):
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(*shape, generator=gen)).half()


def test_matches_float64_values_and_gradients():
    x = _input()
    dy = torch.randn(x.shape, dtype=torch.float64)
    y, rstd = normalize(x, True)
    assert y.dtype == torch.float16 and rstd.dtype == torch.float32 and rstd.numel() == x.numel() // x.shape[-1]
    dx = normalize_backward(y, rstd, dy.float())
    x64 = x.double().requires_grad_()
    y64 = l2norm(x64)
    (dx64,) = torch.autograd.grad((y64 * dy).sum(), x64)
    # float16 output rounding (2^-11 relative) bounds both: the backward reads the rounded output
    assert rel_err(y, y64.detach()) < 2e-3
    assert rel_err(dx, dx64) < 2e-3


@pytest.mark.parametrize("D", [64, 640])
def test_bit_identical_to_fla_l2norm_function(D):
    """FLA's block kernels (D up to 512) and its row kernels (wider), launched by rewy."""
    from fla.modules.norm.l2norm import l2norm as fla_l2norm

    x = _input(seed=1, shape=(2, 37, 3, D))
    dy = torch.randn(x.shape).half()
    ref_in = x.clone().requires_grad_()
    ref_y = fla_l2norm(ref_in, eps=L2NORM_EPS)
    ref_y.backward(dy)
    y, rstd = normalize(x, True)
    assert torch.equal(y, ref_y.detach())
    assert torch.equal(normalize_backward(y, rstd, dy), ref_in.grad)


def test_off_passes_through():
    x = _input(seed=2)
    y, rstd = normalize(x, False)
    assert y is x and rstd is None
    dy = torch.randn(x.shape).half()
    assert normalize_backward(y, rstd, dy) is dy
