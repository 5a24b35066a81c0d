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


def residual_wy_backward(
    A: torch.Tensor, W: torch.Tensor, U: torch.Tensor, dW: torch.Tensor, dU: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dX, dY, dL) from (dW, dU) with exactly two (batched) matrix products."""
    K = W.shape[-1]
    dXY = A.transpose(-1, -2) @ torch.cat([dW, dU], dim=-1)
    dL = -(dXY @ torch.cat([W, U], dim=-1).transpose(-1, -2))
    return dXY[..., :K], dXY[..., K:], dL.tril(-1)
