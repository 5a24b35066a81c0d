"""Chunked forward of the general delta rule (torch backend).

All tensors are chunk-major, ``[NT, N, H, C, D]``, in the compute dtype.
Symbols follow design.md section 3: G cumulative log-gates within a chunk,
X = b*k*e^G, Y = w*v, L the strictly lower gated key Gram, A = (I + L)^{-1},
W = A X, U = A Y, Vn = U - W S, O = scale (q e^G) S + Aqk Vn, and
S' = Diag(e^{G_C}) S + (k e^{G_C - G})^T Vn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import log_gate_floor
from .gated_gram import gram, scalar_decay


@dataclass
class ChunkInputs:
    """The core's inputs in chunk layout. ``b`` is the erase gate (beta for the
    scalar ops), ``w`` the write gate (None when it is the same tensor as b)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor          # [..., C, 1] or [..., C, K]; zeros for DeltaNet
    b: torch.Tensor          # [..., C, 1] or [..., C, K]
    w: torch.Tensor | None   # [..., C, 1] or [..., C, V]; None = tied to b
    scale: float

    @property
    def write_gate(self) -> torch.Tensor:
        return self.b if self.w is None else self.w


@dataclass
class GateTerms:
    """Gate-derived factors shared by forward and backward."""

    G: torch.Tensor       # cumulative log-gates, [..., C, Dg]
    eG: torch.Tensor      # e^G
    eKc: torch.Tensor     # e^{G_C - G}
    decay: torch.Tensor   # e^{G_C}, [..., 1, Dg]
    gamma: torch.Tensor | None  # scalar gates: exp(G_i - G_j) for j < i, else None

    def pair_decay(self, inclusive: bool) -> torch.Tensor | None:
        """The C x C decay of a scalar-gated Gram: exp(G_i - G_j) below the diagonal, and on it
        exp(0) = 1 when ``inclusive``, else 0."""
        if self.gamma is None or not inclusive:
            return self.gamma
        return self.gamma + torch.eye(self.gamma.shape[-1], dtype=self.gamma.dtype, device=self.gamma.device)


def gate_terms(g: torch.Tensor) -> GateTerms:
    G = g.clamp_min(log_gate_floor(g.dtype)).cumsum(-2)
    GC = G[..., -1:, :]
    gamma = scalar_decay(G, inclusive=False) if G.shape[-1] == 1 else None
    return GateTerms(G=G, eG=G.exp(), eKc=(GC - G).exp(), decay=GC.exp(), gamma=gamma)


def wy_factors(x: ChunkInputs, gt: GateTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """X = b*k*e^G and Y = w*v."""
    return x.b * x.k * gt.eG, x.write_gate * x.v


def wy_inverse(x: ChunkInputs, gt: GateTerms) -> torch.Tensor:
    """A = (I + L)^{-1} with L = strictly-lower gated Gram of (b*k, k)."""
    L = gram(x.b * x.k, x.k, gt.G, inclusive=False, decay=gt.pair_decay(False))
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)


def state_pass(
    W: torch.Tensor, U: torch.Tensor, Kc: torch.Tensor, decay: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential inter-chunk recurrence.

    S' = Diag(e^{G_C}) S + Kc^T (U - W S) is linear in S: S' = M S + B with
    M = Diag(e^{G_C}) - Kc^T W and B = Kc^T U. M and B are formed for all
    chunks in two batched products, so the loop is one product per chunk;
    Vn = U - W S then comes from one more batched product.
    Returns (Hs, Vn, final): Hs[n] is the state entering chunk n.
    """
    KcT = Kc.transpose(-1, -2)
    M = transition(KcT, W, decay)
    B = KcT @ U
    Hs = U.new_empty(U.shape[0] + 1, *h0.shape)
    Hs[0] = h0
    for n in range(U.shape[0]):
        torch.baddbmm(B[n].flatten(0, 1), M[n].flatten(0, 1), Hs[n].flatten(0, 1), out=Hs[n + 1].flatten(0, 1))
    Vn = U - W @ Hs[:-1]
    return Hs[:-1], Vn, Hs[-1]


def transition(left: torch.Tensor, right: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Diag(e^{G_C}) - left @ right, the per-chunk state transition ([..., K, K])."""
    M = (left @ right).neg_()
    M.diagonal(dim1=-2, dim2=-1).add_(decay.squeeze(-2))
    return M


def output(x: ChunkInputs, gt: GateTerms, Hs: torch.Tensor, Vn: torch.Tensor, Aqk: torch.Tensor) -> torch.Tensor:
    return x.scale * ((x.q * gt.eG) @ Hs) + Aqk @ Vn


def qk_gram(x: ChunkInputs, gt: GateTerms) -> torch.Tensor:
    """Aqk = scale * causal (inclusive) gated Gram of (q, k)."""
    return x.scale * gram(x.q, x.k, gt.G, inclusive=True, decay=gt.pair_decay(True))
