"""Chunked forward of the general delta rule (torch backend).

All tensors are in the chunk layout ``[N, H, NT, C, D]`` in the compute dtype.
Symbols follow design.md section 3: G cumulative log-gates within a chunk,
X = b*k*e^G, Y = w*v, L the strictly lower gated key Gram, A = (I + L)^{-1},
W = A X, U = A Y, Vn = U - W S, O = scale (q e^G) S + Aqk Vn, and
S' = Diag(e^{G_C}) S + (k e^{G_C - G})^T Vn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gated_gram import gram


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


def gate_terms(g: torch.Tensor) -> GateTerms:
    G = g.cumsum(-2)
    GC = G[..., -1:, :]
    return GateTerms(G=G, eG=G.exp(), eKc=(GC - G).exp(), decay=GC.exp())


def wy_factors(x: ChunkInputs, gt: GateTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """X = b*k*e^G and Y = w*v."""
    return x.b * x.k * gt.eG, x.write_gate * x.v


def wy_inverse(x: ChunkInputs, gt: GateTerms) -> torch.Tensor:
    """A = (I + L)^{-1} with L = strictly-lower gated Gram of (b*k, k)."""
    L = gram(x.b * x.k, x.k, gt.G, inclusive=False)
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)


def state_pass(
    W: torch.Tensor, U: torch.Tensor, Kc: torch.Tensor, decay: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential inter-chunk recurrence.

    Returns (Hs, Vn, final): Hs[:, :, n] is the state entering chunk n. The loop
    runs on chunk-major copies so each step's operands are contiguous and the
    batched products need no hidden copies.
    """
    W, U, KcT = (chunk_major(t) for t in (W, U, Kc.transpose(-1, -2)))
    dec = chunk_major(decay.transpose(-1, -2))      # [NT, N, H, Dg, 1]: scales the K rows of S
    NT = U.shape[0]
    S = h0
    Hs = U.new_empty(NT, *h0.shape)
    Vn = torch.empty_like(U)
    for n in range(NT):
        Hs[n] = S
        torch.baddbmm(U[n].flatten(0, 1), W[n].flatten(0, 1), S.flatten(0, 1), beta=1, alpha=-1,
                      out=Vn[n].flatten(0, 1))
        S = torch.baddbmm((dec[n] * S).flatten(0, 1), KcT[n].flatten(0, 1), Vn[n].flatten(0, 1)).view_as(S)
    return Hs.movedim(0, 2), Vn.movedim(0, 2), S


def chunk_major(t: torch.Tensor) -> torch.Tensor:
    """[N, H, NT, ...] -> contiguous [NT, N, H, ...]."""
    return t.movedim(2, 0).contiguous()


def output(x: ChunkInputs, gt: GateTerms, Hs: torch.Tensor, Vn: torch.Tensor, Aqk: torch.Tensor) -> torch.Tensor:
    return x.scale * ((x.q * gt.eG) @ Hs) + Aqk @ Vn


def qk_gram(x: ChunkInputs, gt: GateTerms) -> torch.Tensor:
    """Aqk = scale * causal (inclusive) gated Gram of (q, k)."""
    return x.scale * gram(x.q, x.k, gt.G, inclusive=True)
