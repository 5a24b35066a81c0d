"""Residual WY: the local WY backward in two matrix products.

Forward (per chunk): A = (I + L)^{-1}, W = A X, U = A Y. The textbook backward
forms dA = dW X^T + dU Y^T, dX = A^T dW, dY = A^T dU and dL = -A^T dA A^T: six
C-sized products. Because X^T A^T = W^T and Y^T A^T = U^T,

    dL = -A^T (dW X^T + dU Y^T) A^T = -(A^T dW) W^T - (A^T dU) U^T = -[dX dY] [W U]^T,

so one product gives [dX dY] = A^T [dW dU] and a second gives dL. Only the
strictly lower part of dL is meaningful, since L is strictly lower triangular.
"""

from __future__ import annotations

import torch

from .gated_gram import gram_backward


def residual_wy_backward(A: torch.Tensor, WU: torch.Tensor, dWU: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([dX dY], dL) from [dW dU] with exactly two (batched) matrix products.

    ``WU`` and ``dWU`` hold W, U (and dW, dU) side by side on the last axis.
    Only the strictly lower part of the returned dL is meaningful; its
    consumers mask it, so no mask is spent here.
    """
    dXY = A.transpose(-1, -2) @ dWU
    dL = (dXY @ WU.transpose(-1, -2)).neg_()
    return dXY, dL


def wy_backward(
    A: torch.Tensor,
    WU: torch.Tensor,
    dW: torch.Tensor,
    dU: torch.Tensor,
    a: torch.Tensor,
    k: torch.Tensor,
    G: torch.Tensor,
    b: torch.Tensor,
    decay: torch.Tensor | None = None,
):
    """The whole local WY backward: (dW, dU) -> (dX, dY, Ra, Rc).

    L is the strictly lower gated Gram of (a = b*k, k); Ra and Rc are its
    gradients with respect to a (rows) and k (columns). For scalar gates and a
    scalar erase gate (GDN, DeltaNet) this is three products in all: two here
    and one stacked product in the Gram backward.
    """
    K = dW.shape[-1]
    dXY, dL = residual_wy_backward(A, WU, torch.cat([dW, dU], dim=-1))
    scalar = G.shape[-1] == 1 and b.shape[-1] == 1
    Ra, Rc = gram_backward(dL, a, k, G, inclusive=False, row_scale=b if scalar else None, decay=decay)
    return dXY[..., :K], dXY[..., K:], Ra, Rc
