"""The torch backend's autograd Function: chunked forward, ReWY backward.

Inputs arrive already preprocessed (l2norm, gate and beta activations are plain
torch ops outside, so autograd chains through them), in the compute dtype and
the chunk-major layout ``[NT, N, H, C, D]`` (C = 64); see layout.py.

Save policies:
- ``recompute``: keep the inputs and A = (I + L)^{-1} (T x C per head); rebuild
  [W U] (one product), Aqk and the chunk states in backward.
- ``full``: keep [W U], the states, Vn and Aqk as well; backward skips the
  recomputation at the cost of one K x V state per chunk.
Neither policy rebuilds the key Gram L in backward.
"""

from __future__ import annotations

import torch

from ..constants import CHUNK
from .chunk_backward import Saved, local_backward, reverse_state_pass
from .chunk_forward import ChunkInputs, gate_terms, output, qk_gram, state_pass, wy_factors, wy_inverse

POLICIES = ("recompute", "full")


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


class ReWYChunkFunction(torch.autograd.Function):
    """o, ht = f(q, k, v, g, b, w, h0); see module docstring for the contract."""

    @staticmethod
    def forward(ctx, q, k, v, g, b, w, h0, scale: float, policy: str):
        if q.shape[-2] != CHUNK:
            raise ValueError(f"the torch core expects chunks of {CHUNK} tokens, got {q.shape[-2]}")
        has_g = g is not None
        if g is None:
            g = q.new_zeros(*q.shape[:-1], 1)
        x = ChunkInputs(q, k, v, g, b, w, scale=scale)
        _, N, H, _, K = q.shape
        state0 = h0 if h0 is not None else q.new_zeros(N, H, K, v.shape[-1])
        gt, s, ht = forward_pass(x, state0)
        o = output(x, gt, s.Hs, s.Vn, s.Aqk)

        extra = (s.WU, s.Hs, s.Vn, s.Aqk) if policy == "full" else ()
        ctx.save_for_backward(q, k, v, g, b, w, state0, s.A, *extra)
        ctx.meta = (scale, policy, has_g, h0 is not None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        # backward() may be called inside an autocast region; the math stays in its own dtype.
        with torch.autocast(do.device.type, enabled=False):
            return ReWYChunkFunction._backward(ctx, do, dht)

    @staticmethod
    def _backward(ctx, do, dht):
        scale, policy, has_g, has_h0 = ctx.meta
        q, k, v, g, b, w, state0, A, *extra = ctx.saved_tensors
        x = ChunkInputs(q, k, v, g, b, w, scale=scale)
        if policy == "full":
            gt = gate_terms(x.g)
            s = Saved(A, *extra)
        else:
            gt, s, _ = forward_pass(x, state0, A)
        if dht is None:
            dht = torch.zeros_like(state0)
        do = do.to(q.dtype).contiguous()
        dVn, dHnext, dh0 = reverse_state_pass(x, gt, s, do, dht.to(q.dtype))
        grads = local_backward(x, gt, s, do, dVn, dHnext)
        dq, dk, dv, dg, db, dw = grads
        return dq, dk, dv, dg if has_g else None, db, dw, dh0 if has_h0 else None, None, None
