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
input dtype first, as autograd hands it to that function. The kernels are
launched here as FLA's ``l2norm_fwd`` / ``l2norm_bwd`` launch them, through
``launch.launch``, without FLA's dispatch and autotuner wrappers: four
launches per layer and step.
"""

from __future__ import annotations

import torch
import triton

from ..reference import L2NORM_EPS
from .launch import launch

# FLA's row-per-program kernels above this width, its block kernels up to it
BLOCK_KERNEL_MAX_D = 512


def _widths(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows, D, BD) of x as FLA's l2norm functions size their launch."""
    D = x.shape[-1]
    BD = min(65536 // x.element_size(), triton.next_power_of_2(D))
    if D > BD:
        raise ValueError(f"the q/k l2norm takes rows of at most {BD} values at {x.dtype} (got {D})")
    return x.numel() // D, D, BD


def _l2norm_kernels():
    from fla.modules.norm import l2norm

    return l2norm


def normalize(x: torch.Tensor, on: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows of x over the last dim scaled to unit length, in x's dtype; their float32
    inverse norms), or (x, None) when ``on`` is False."""
    if not on:
        return x, None
    fla = _l2norm_kernels()
    x = x.contiguous()
    T, D, BD = _widths(x)
    y = torch.empty_like(x)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    if D <= BLOCK_KERNEL_MAX_D:
        launch(fla.l2norm_fwd_kernel, lambda meta: (triton.cdiv(T, meta["BT"]),), x=x, y=y, rstd=rstd,
               eps=L2NORM_EPS, T=T, D=D, BD=BD, NB=triton.cdiv(T, 2048 * 32))
    else:
        launch(fla.l2norm_fwd_kernel_row, (T,), x=x, y=y, rstd=rstd, eps=L2NORM_EPS, D=D, BD=BD)
    return y, rstd


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
    fla = _l2norm_kernels()
    dy = dy.contiguous()
    T, D, BD = _widths(y)
    dx = torch.empty_like(y)
    if D <= BLOCK_KERNEL_MAX_D:
        launch(fla.l2norm_bwd_kernel, lambda meta: (triton.cdiv(T, meta["BT"]),), y=y, rstd=rstd, dy=dy, dx=dx,
               eps=L2NORM_EPS, T=T, D=D, BD=BD, NB=triton.cdiv(T, 2048 * 32))
    else:
        launch(fla.l2norm_bwd_kernel_row, (T,), y=y, rstd=rstd, dy=dy, dx=dx, eps=L2NORM_EPS, D=D, BD=BD)
    return dx
