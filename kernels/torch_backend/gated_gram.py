"""Gated Gram matrices inside a chunk, and their two backward contractions.

For row factors ``a``, column factors ``c`` and cumulative log-gates ``G`` of one
chunk, the gated Gram is

    M_ij = sum_d a_id c_jd exp(G_id - G_jd)        (j < i, or j <= i)

Both the WY matrix ``L`` (a = b*k, c = k) and the output matrix ``Aqk``
(a = q, c = k) have this form. Every tensor here is ``[..., C, D]`` with the
chunk as the second-to-last axis; ``G`` is ``[..., C, 1]`` for scalar gates and
``[..., C, K]`` for vector gates.

Scalar gates factor exactly: M = (a c^T) * Gamma with Gamma_ij = exp(G_i - G_j).
Vector gates do not, and this is where Matrix Intra comes in: the chunk is cut
into blocks of ``BLOCK`` rows. For a block I below the diagonal of block J the
decay is split through the first row r of block I,

    exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j),   i >= r > j,

and both factors are <= 1 when the gates are non-positive, so the block is one
matrix product of bounded operands. Only the diagonal blocks are done
elementwise, on a BLOCK x BLOCK x K tensor with exponents clamped by the causal
mask, so no exponent ever overflows whatever the gate values.
"""

from __future__ import annotations

import torch

BLOCK = 16


def causal_mask(n: int, inclusive: bool, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(0 if inclusive else -1)


def scalar_decay(G: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """Gamma_ij = exp(G_i - G_j) on the causal part, 0 elsewhere. G: [..., C, 1]."""
    g = G[..., 0]
    mask = causal_mask(g.shape[-1], inclusive, g.device)
    diff = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~mask, float("-inf"))
    return diff.exp()


class _Blocks:
    """The bounded factors of the Matrix Intra split for one call."""

    def __init__(self, a: torch.Tensor, c: torch.Tensor, G: torch.Tensor, inclusive: bool):
        C = a.shape[-2]
        if C % BLOCK:
            raise ValueError(f"chunk size {C} is not a multiple of the block size {BLOCK}")
        nb = C // BLOCK
        self.nb = nb
        self.aB = a.unflatten(-2, (nb, BLOCK))
        self.cB = c.unflatten(-2, (nb, BLOCK))
        GB = G.unflatten(-2, (nb, BLOCK))
        ref = GB[..., :1, :]                                   # first row of each block
        self.row = (GB - ref).exp()                            # exp(G_i - G_r) <= 1
        pos = torch.arange(C, device=a.device)
        before_ref = pos.unsqueeze(0) < (torch.arange(nb, device=a.device) * BLOCK).unsqueeze(1)
        expo = ref - G.unsqueeze(-3)                           # [..., nb, C, K]
        self.col = expo.masked_fill(~before_ref.unsqueeze(-1), float("-inf")).exp()
        tri = causal_mask(BLOCK, inclusive, a.device)
        diff = GB.unsqueeze(-2) - GB.unsqueeze(-3)             # [..., nb, Bi, Bj, K]
        self.diag = diff.masked_fill(~tri.unsqueeze(-1), float("-inf")).exp()


def _diag_blocks(M: torch.Tensor, nb: int) -> torch.Tensor:
    """View of the nb diagonal BLOCK x BLOCK blocks of M as [..., nb, Bi, Bj]."""
    M4 = M.unflatten(-1, (nb, BLOCK)).unflatten(-3, (nb, BLOCK))    # [..., I, i, J, j]
    return torch.diagonal(M4, dim1=-4, dim2=-2).movedim(-1, -3)


def gram(a: torch.Tensor, c: torch.Tensor, G: torch.Tensor, inclusive: bool,
         decay: torch.Tensor | None = None) -> torch.Tensor:
    """M_ij = sum_d a_id c_jd exp(G_id - G_jd) on the causal part. Returns [..., C, C].

    ``decay`` may carry a precomputed ``scalar_decay(G, inclusive)``."""
    if G.shape[-1] == 1:
        return (a @ c.transpose(-1, -2)) * (scalar_decay(G, inclusive) if decay is None else decay)
    blk = _Blocks(a, c, G, inclusive)
    off = (blk.aB * blk.row) @ (c.unsqueeze(-3) * blk.col).transpose(-1, -2)   # [..., nb, Bi, C]
    M = off.flatten(-3, -2)
    _diag_blocks(M, blk.nb).add_(torch.einsum("...nik,...njk,...nijk->...nij", blk.aB, blk.cB, blk.diag))
    return M


def gram_backward(
    dM: torch.Tensor,
    a: torch.Tensor,
    c: torch.Tensor,
    G: torch.Tensor,
    inclusive: bool,
    row_scale: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(dM * gram(a, c, G))`` with respect to ``a`` and ``c``.

    Returns (Ra, Rc). The gate gradient needs no further product: it is
    ``a * Ra - c * Rc`` (per channel; summed over channels for scalar gates),
    because every term a_id c_jd exp(G_id - G_jd) enters Ra at row i and Rc at
    column j with the same weight. That is Gram Elimination: the gate gradient
    comes from the two halves the key gradient needs anyway.

    ``row_scale`` (scalar gates only) declares ``a == row_scale * c`` with
    row_scale of shape [..., C, 1]; both halves then come from one product with
    the stacked left operand [P; P^T Diag(row_scale)], where P = dM * Gamma.
    """
    if G.shape[-1] == 1:
        P = dM * (scalar_decay(G, inclusive) if decay is None else decay)
        if row_scale is not None:
            Pt = P.transpose(-1, -2) * row_scale.transpose(-1, -2)
            R = torch.cat([P, Pt], dim=-2) @ c
            C = P.shape[-1]
            return R[..., :C, :], R[..., C:, :]
        return P @ c, P.transpose(-1, -2) @ a
    blk = _Blocks(a, c, G, inclusive)
    # Entries of dM outside the causal part meet zero factors below (the
    # column factors vanish from each block's first row on, the diagonal
    # blocks are masked), so dM needs no mask of its own.
    dMB = dM.unflatten(-2, (blk.nb, BLOCK))                              # [..., nb, Bi, C]
    c_col = c.unsqueeze(-3) * blk.col                                    # [..., nb, C, K]
    a_row = blk.aB * blk.row                                             # [..., nb, Bi, K]
    Ra = ((dMB @ c_col) * blk.row).flatten(-3, -2)
    Rc = ((dMB.transpose(-1, -2) @ a_row) * blk.col).sum(-3)
    dMd = _diag_blocks(dM, blk.nb)
    Ra = Ra + torch.einsum("...nij,...njk,...nijk->...nik", dMd, blk.cB, blk.diag).flatten(-3, -2)
    Rc = Rc + torch.einsum("...nij,...nik,...nijk->...njk", dMd, blk.aB, blk.diag).flatten(-3, -2)
    return Ra, Rc
