"""Hand-written chunked backward of the general delta rule (torch backend).

Stages, in the order they run:
1. the reverse inter-chunk recurrence for dS and dVn (sequential over chunks);
2. local products with the saved/recomputed states: dW, dU, dq (inter), dAqk,
   the key gradient from the next state, and the decay's gate gradient;
3. Residual WY: (dW, dU) -> (dX, dY, dL) in two products;
4. the gated Gram backward of L and Aqk (Matrix Intra for vector gates; one
   stacked product for the scalar-gate key Gram), with the gate gradient from
   the same partial sums (Gram Elimination: L is never rebuilt in backward);
5. reverse cumulative sum of the gate gradient inside each chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chunk_forward import ChunkInputs, GateTerms, chunk_major
from .gated_gram import gram_backward
from .residual_wy import wy_backward


@dataclass
class Saved:
    """Forward intermediates the backward consumes (saved or recomputed)."""

    A: torch.Tensor
    W: torch.Tensor
    U: torch.Tensor
    Hs: torch.Tensor
    Vn: torch.Tensor
    Aqk: torch.Tensor


def reverse_state_pass(
    x: ChunkInputs, gt: GateTerms, s: Saved, do: torch.Tensor, dht: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dVn, dHnext, dh0); dHnext[:, :, n] is the gradient of the state
    leaving chunk n. Runs chunk-major, like the forward state pass."""
    Kc = chunk_major(x.k * gt.eKc)
    dVn = chunk_major(s.Aqk.transpose(-1, -2) @ do)
    QdO = chunk_major(x.scale * (x.q * gt.eG).transpose(-1, -2) @ do)
    dec = chunk_major(gt.decay.transpose(-1, -2))
    WT = chunk_major(s.W.transpose(-1, -2))
    dHnext = dht.new_empty(dVn.shape[0], *dht.shape)
    dS = dht
    for n in reversed(range(dVn.shape[0])):
        dHnext[n] = dS
        dv = dVn[n].flatten(0, 1)
        dv.baddbmm_(Kc[n].flatten(0, 1), dS.flatten(0, 1))
        dS = torch.baddbmm((dec[n] * dS + QdO[n]).flatten(0, 1), WT[n].flatten(0, 1), dv, alpha=-1).view_as(dS)
    return dVn.movedim(0, 2), dHnext.movedim(0, 2), dS


def local_backward(x: ChunkInputs, gt: GateTerms, s: Saved, do: torch.Tensor, dVn: torch.Tensor, dHnext: torch.Tensor):
    """Gradients of q, k, v, g, b, w given the state-pass results.

    Gate gradients are accumulated per channel in dG ([..., C, K]) and reduced
    to the gate's own width at the end.
    """
    q, k, v, b, wg = x.q, x.k, x.v, x.b, x.write_gate
    G, eG = gt.G, gt.eG
    HsT = s.Hs.transpose(-1, -2)

    # Products with the states entering / leaving each chunk.
    dW = -(dVn @ HsT)
    dQg = x.scale * (do @ HsT)
    dAqk = (do @ s.Vn.transpose(-1, -2)).tril()
    Kc = k * gt.eKc
    dKc = s.Vn @ dHnext.transpose(-1, -2)
    dGC = (s.Hs * dHnext).sum(-1).unsqueeze(-2) * gt.decay.expand(*gt.decay.shape[:-1], k.shape[-1])

    # Residual WY, then the key Gram L (Gram Elimination gives its gate term).
    a = b * k
    dX, dY, Ra, Rc = wy_backward(s.A, s.W, s.U, dW, dVn, a, k, G, b)
    da = dX * eG + Ra
    dk = Rc
    dG = dX * a * eG + a * Ra - k * Rc

    # Output Gram Aqk = scale * gram(q, k).
    Rq, Rk = gram_backward(x.scale * dAqk, q, k, G, inclusive=True)
    dq = Rq + dQg * eG
    dk = dk + Rk + dKc * gt.eKc
    dG = dG + q * Rq - k * Rk + dQg * q * eG - dKc * Kc
    dGC = dGC + (dKc * Kc).sum(-2, keepdim=True)
    dG = torch.cat([dG[..., :-1, :], dG[..., -1:, :] + dGC], dim=-2)

    if G.shape[-1] == 1:
        dG = dG.sum(-1, keepdim=True)
    dg = dG.flip(-2).cumsum(-2).flip(-2)

    dk = dk + da * b
    db = _reduce_to(da * k, b)
    dv = dY * wg
    dw = _reduce_to(dY * v, wg)
    if x.w is None:
        return dq, dk, dv, dg, db + dw, None
    return dq, dk, dv, dg, db, dw


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return grad.sum(-1, keepdim=True) if like.shape[-1] == 1 else grad
