"""The torch backend's chunked forward and ReWY backward, in the chunk-major layout.

Inputs arrive already preprocessed (l2norm, gate and beta activations happen
before the core), in the compute dtype and the layout ``[NT, N, H, C, D]``
(C = 64; see layout.py). ``chunk_forward`` returns the output, the final state
and what the backward needs; ``chunk_backward`` turns that back into input
gradients. Neither is an autograd Function: the autograd boundary, the same
for both backends, is kernels/core.py.

Save policies:
- ``recompute``: keep A = (I + L)^{-1} (T x C per head); rebuild [W U] (one
  product), Aqk and the chunk states in backward.
- ``full``: keep [W U], the states, Vn and Aqk as well; backward skips the
  recomputation at the cost of one K x V state per chunk.
Neither policy rebuilds the key Gram L in backward.
"""

from __future__ import annotations

import torch

from ..constants import CHUNK
from .chunk_backward import Saved, local_backward, reverse_state_pass
from .chunk_forward import ChunkInputs, gate_terms, output, qk_gram, state_pass, wy_factors, wy_inverse


def forward_pass(x: ChunkInputs, h0: torch.Tensor, A: torch.Tensor | None = None):
    gt = gate_terms(x.g)
    if A is None:
        A = wy_inverse(x, gt)
    X, Y = wy_factors(x, gt)
    WU = A @ torch.cat([X, Y], dim=-1)          # W = A X and U = A Y in one product
    K = X.shape[-1]
    Hs, Vn, ht = state_pass(WU[..., :K], WU[..., K:], x.k * gt.eKc, gt.decay, h0)
    Aqk = qk_gram(x, gt)
    return gt, Saved(A=A, WU=WU, Hs=Hs, Vn=Vn, Aqk=Aqk), ht


def _inputs(q, k, v, g, b, w, scale) -> ChunkInputs:
    if q.shape[-2] != CHUNK:
        raise ValueError(f"the torch core expects chunks of {CHUNK} tokens, got {q.shape[-2]}")
    if g is None:
        g = q.new_zeros(*q.shape[:-1], 1)
    return ChunkInputs(q, k, v, g, b, w, scale=scale)


def chunk_forward(q, k, v, g, b, w, h0, scale: float, policy: str):
    """(o, final state, saved): ``saved`` is [A] under ``recompute``, [A, WU, Hs, Vn, Aqk] under
    ``full``. h0: the initial state [N, H, K, V] (zeros when the caller has none)."""
    x = _inputs(q, k, v, g, b, w, scale)
    gt, s, ht = forward_pass(x, h0)
    o = output(x, gt, s.Hs, s.Vn, s.Aqk)
    return o, ht, [s.A, s.WU, s.Hs, s.Vn, s.Aqk] if policy == "full" else [s.A]


def saved_shapes(NT, N, H, K, V, policy: str) -> list[tuple]:
    """The shapes of ``chunk_forward``'s saved tensors, in its order."""
    shapes = [(NT, N, H, CHUNK, CHUNK)]
    if policy == "full":
        shapes += [(NT, N, H, CHUNK, K + V), (NT, N, H, K, V), (NT, N, H, CHUNK, V), (NT, N, H, CHUNK, CHUNK)]
    return shapes


def chunk_backward(q, k, v, g, b, w, h0, saved: list, scale: float, policy: str, do, dht):
    """(dq, dk, dv, dg, db, dw, dh0) in the chunk layout; dg is None for DeltaNet (g None),
    dw None without a write gate. ``dht`` may be None (the final state unused)."""
    x = _inputs(q, k, v, g, b, w, scale)
    if policy == "full":
        gt, s = gate_terms(x.g), Saved(*saved)
    else:
        gt, s, _ = forward_pass(x, h0, saved[0])
    dht = torch.zeros_like(h0) if dht is None else dht.to(q.dtype)
    dVn, dHnext, dh0 = reverse_state_pass(x, gt, s, do.to(q.dtype).contiguous(), dht)
    dq, dk, dv, dg, db, dw = local_backward(x, gt, s, do.to(q.dtype).contiguous(), dVn, dHnext)
    return dq, dk, dv, dg if g is not None else None, db, dw, dh0
