"""The q/k l2norm of the Triton backends, inside rewy's autograd functions.

FLA's ops normalise q and k inside their own autograd function: ``l2norm_fwd``
in the forward, ``l2norm_bwd`` on the gradient in the backward. rewy first did
it as FLA's separate ``l2norm`` autograd function per tensor, which computes
the same values but adds two autograd nodes per layer in each direction, and a
host-bound training step pays for each node (a qwen3.5-1b step at 1 x 4096 on
the H200 spent about 12 ms of profiled host time in them). These helpers run
the kernels of that function on the same inputs, so the results are
bit-identical to it: the normalised rows in the input dtype, one float32
inverse norm per row kept for backward, and the incoming gradient cast to the
input dtype first, as autograd hands it to that function.
"""

from __future__ import annotations

import torch

from ..reference import L2NORM_EPS


def normalize(x: torch.Tensor, on: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows of x over the last dim scaled to unit length, in x's dtype; their float32
    inverse norms), or (x, None) when ``on`` is False."""
    if not on:
        return x, None
    from fla.modules.norm.l2norm import l2norm_fwd

    return l2norm_fwd(x.contiguous(), eps=L2NORM_EPS)


def normalize_backward(y: torch.Tensor, rstd: torch.Tensor | None, dy: torch.Tensor,
                       cast: bool = True) -> torch.Tensor:
    """The gradient with respect to the raw rows, in y's dtype, from ``dy`` with respect to the
    normalised rows ``y`` (``rstd`` None: nothing was normalised, dy passes through). ``cast``: dy
    is rounded to y's dtype first, as autograd hands it to FLA's l2norm function; without it the
    kernel (float32 inside) reads dy as it is, as FlashQLA's own function reads its float32
    gradients."""
    if cast or rstd is None:
        dy = dy.to(y.dtype)
    if rstd is None:
        return dy
    from fla.modules.norm.l2norm import l2norm_bwd

    return l2norm_bwd(y, rstd, dy.contiguous(), eps=L2NORM_EPS)
