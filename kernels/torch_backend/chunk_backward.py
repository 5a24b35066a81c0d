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

from .chunk_forward import ChunkInputs, GateTerms, transition
from .gated_gram import gram_backward
from .residual_wy import wy_backward


@dataclass
class Saved:
    """Forward intermediates the backward consumes (saved or recomputed)."""

    A: torch.Tensor
    WU: torch.Tensor      # [W U] side by side: W = A X, U = A Y
    Hs: torch.Tensor
    Vn: torch.Tensor
    Aqk: torch.Tensor

    @property
    def W(self) -> torch.Tensor:
        return self.WU[..., : self.Hs.shape[-2]]


def reverse_state_pass(
    x: ChunkInputs, gt: GateTerms, s: Saved, do: torch.Tensor, dht: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dVn, dHnext, dh0); dHnext[n] is the gradient of the state
    leaving chunk n.

    With dVn = Aqk^T dO + Kc dS', the gradient of the entering state is
    dS = M^T dS' + R, M^T = Diag(e^{G_C}) - W^T Kc, R = scale (q e^G)^T dO - W^T Aqk^T dO:
    the transpose of the forward recurrence, again one product per chunk.
    """
    Kc = x.k * gt.eKc
    WT = s.W.transpose(-1, -2)
    dVn_local = s.Aqk.transpose(-1, -2) @ do
    R = (x.scale * (x.q * gt.eG)).transpose(-1, -2) @ do - WT @ dVn_local
    MT = transition(WT, Kc, gt.decay)
    dH = dht.new_empty(do.shape[0] + 1, *dht.shape)
    dH[-1] = dht
    for n in reversed(range(do.shape[0])):
        torch.baddbmm(R[n].flatten(0, 1), MT[n].flatten(0, 1), dH[n + 1].flatten(0, 1), out=dH[n].flatten(0, 1))
    dVn = dVn_local + Kc @ dH[1:]
    return dVn, dH[1:], dH[0]


def local_backward(x: ChunkInputs, gt: GateTerms, s: Saved, do: torch.Tensor, dVn: torch.Tensor, dHnext: torch.Tensor):
    """Gradients of q, k, v, g, b, w given the state-pass results."""
    q, k, v, b, wg = x.q, x.k, x.v, x.b, x.write_gate
    eG = gt.eG
    HsT = s.Hs.transpose(-1, -2)

    # Products with the states entering / leaving each chunk.
    dW = (dVn @ HsT).neg_()
    dQg = do @ HsT
    dAqk = do @ s.Vn.transpose(-1, -2)        # the Gram backward keeps only its causal part
    Kc = k * gt.eKc
    dKc = s.Vn @ dHnext.transpose(-1, -2)

    # Residual WY and the key Gram L, then the output Gram Aqk = scale * gram(q, k).
    # Aqk's diagonal (decay e^0 = 1) is added apart from its strictly lower part:
    # it carries no gate, and leaving it out of the gate gradient below keeps that
    # gradient from being the small difference of two large terms under strong decay.
    a = b * k
    dX, dY, Ra, Rc = wy_backward(s.A, s.WU, dW, dVn, a, k, gt.G, b, decay=gt.pair_decay(False))
    Rq, Rk = gram_backward(dAqk, q, k, gt.G, inclusive=False, decay=gt.pair_decay(False))
    diag = dAqk.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    da = dX * eG + Ra
    dQ = Rq + dQg * eG
    dkg = Rc + Rk.mul_(x.scale)

    # Gate gradient without any further product (Gram Elimination): a Gram term
    # exp(G_i - G_j) depends on g_s for j < s <= i, so it enters at its row with
    # its operand times its gradient and leaves at its column with the negative;
    # X = a e^G and q e^G enter at their row. Summed from the chunk's end, the
    # terms wholly after s cancel and only those spanning s are left.
    dG = a * da + x.scale * (q * dQ) - k * dkg
    # k_i e^{G_C - G_i} and the carried state's e^{G_C} depend on g_s for i < s:
    # a forward (exclusive) sum, so no term is added and then taken away again.
    dKg = Kc * dKc
    dGC = (s.Hs * dHnext).sum(-1).unsqueeze(-2) * gt.decay
    if gt.G.shape[-1] == 1:
        dG, dKg, dGC = dG.sum(-1, keepdim=True), dKg.sum(-1, keepdim=True), dGC.sum(-1, keepdim=True)
    before = torch.cat([torch.zeros_like(dKg[..., :1, :]), dKg[..., :-1, :].cumsum(-2)], dim=-2)
    dg = dG.flip(-2).cumsum(-2).flip(-2) + before + dGC       # G_i = sum_{s<=i} g_s
    dq = (dQ + diag * k).mul_(x.scale)
    dkg = dkg + x.scale * diag * q

    dk = dkg + dKc * gt.eKc + da * b
    db = _reduce_to(da * k, b)
    dv = dY * wg
    dw = _reduce_to(dY * v, wg)
    if x.w is None:
        return dq, dk, dv, dg, db + dw, None
    return dq, dk, dv, dg, db, dw


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return grad.sum(-1, keepdim=True) if like.shape[-1] == 1 else grad
