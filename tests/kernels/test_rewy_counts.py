"""The ReWY identities as counts, recorded with a TorchDispatchMode.

- Residual WY: (dW, dU) -> (dX, dY, dL) issues exactly two matrix products per
  chunk batch, and the whole GDN/DeltaNet WY backward three.
- Gram Elimination: no matrix product in backward produces the key Gram
  K K^T or the gated key Gram L. A positive control shows the same detector
  finds L in the forward pass, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from rewy_hf.kernels.constants import CHUNK
from rewy_hf.kernels.torch_backend.chunk_forward import ChunkInputs, gate_terms, wy_factors, wy_inverse
from rewy_hf.kernels.torch_backend.function import chunk_backward, chunk_forward
from rewy_hf.kernels.torch_backend.gated_gram import gram
from rewy_hf.kernels.torch_backend.residual_wy import residual_wy_backward, wy_backward

MATMUL_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.mv.default, torch.ops.aten.dot.default,
}


class ProductRecorder(TorchDispatchMode):
    """Records the output of every matrix product dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMUL_OPS:
            self.outputs.append(out.detach().clone())
        return out


def _chunk_inputs(kind: str, N=2, H=2, NT=3, K=16, V=8, seed=0):
    """Random inputs in the core's chunk-major layout [NT, N, H, C, D]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NT, N, H, CHUNK)
    r = lambda d: torch.randn(*shape, d, generator=gen, dtype=torch.float64)
    q, k, v = r(K), F.normalize(r(K), dim=-1), r(V)
    g = None if kind == "delta_rule" else F.logsigmoid(r(K if kind in ("kda", "gdn2") else 1))
    b = torch.rand(*shape, K if kind == "gdn2" else 1, generator=gen, dtype=torch.float64)
    w = torch.rand(*shape, V, generator=gen, dtype=torch.float64) if kind == "gdn2" else None
    return q, k, v, g, b, w


def _wy_state(kind: str):
    q, k, v, g, b, w = _chunk_inputs(kind)
    g = torch.zeros_like(b[..., :1]) if g is None else g
    x = ChunkInputs(q, k, v, g, b, w, scale=0.25)
    gt = gate_terms(x.g)
    A = wy_inverse(x, gt)
    X, Y = wy_factors(x, gt)
    WU = torch.cat([A @ X, A @ Y], dim=-1)
    gen = torch.Generator().manual_seed(1)
    dW = torch.randn(X.shape, generator=gen, dtype=X.dtype)
    dU = torch.randn(Y.shape, generator=gen, dtype=Y.dtype)
    return x, gt, A, WU, dW, dU


@pytest.mark.parametrize("kind", ["delta_rule", "gdn", "kda", "gdn2"])
def test_residual_wy_two_products(kind):
    x, gt, A, WU, dW, dU = _wy_state(kind)
    with ProductRecorder() as rec:
        dXY, dL = residual_wy_backward(A, WU, torch.cat([dW, dU], dim=-1))
    assert len(rec.outputs) == 2, f"expected 2 products, got {len(rec.outputs)}"
    # and they are the textbook gradients (six products the long way)
    X, Y = wy_factors(x, gt)
    K = X.shape[-1]
    At = A.transpose(-1, -2)
    dA = dW @ X.transpose(-1, -2) + dU @ Y.transpose(-1, -2)
    assert torch.allclose(dXY[..., :K], At @ dW, rtol=1e-12, atol=1e-12)
    assert torch.allclose(dXY[..., K:], At @ dU, rtol=1e-12, atol=1e-12)
    assert torch.allclose(dL.tril(-1), (-(At @ dA @ At)).tril(-1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["delta_rule", "gdn"])
def test_scalar_gate_wy_backward_three_products(kind):
    x, gt, A, WU, dW, dU = _wy_state(kind)
    with ProductRecorder() as rec:
        wy_backward(A, WU, dW, dU, x.b * x.k, x.k, gt.G, x.b, decay=gt.pair_decay(False))
    assert len(rec.outputs) == 3, f"expected 3 products, got {len(rec.outputs)}"


def _forbidden_grams(kind):
    """Every form of the key Gram per chunk: K K^T, (b*K) K^T, and gated L
    with and without the erase gate."""
    q, kc, v, g, bc, w = _chunk_inputs(kind)
    G = (torch.zeros_like(bc[..., :1]) if g is None else g).cumsum(-2)
    return [kc @ kc.transpose(-1, -2), (bc * kc) @ kc.transpose(-1, -2),
            gram(bc * kc, kc, G, inclusive=False), gram(kc, kc, G, inclusive=False)]


def _block_lower(C: int, block: int = 16) -> torch.Tensor:
    """Entries (i, j) with j before the 16-row block of i. Matrix Intra forms
    exactly these entries of L as products (the diagonal blocks elementwise),
    so a Gram formed whole or by blocks agrees with the target on them."""
    i = torch.arange(C).unsqueeze(1)
    return torch.arange(C).unsqueeze(0) < (i // block) * block


def _matches(out: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a product holds a chunk's Gram from ``target``, on the entries Matrix Intra forms as
    products: any [R, C] slice of it (R = C, or the 16-row blocks KDA's forward forms) equal to the
    same rows of some chunk's Gram, so a Gram formed whole, per chunk, per head, by row blocks or in
    any batch order is found."""
    C = target.shape[-1]
    if out.dim() < 2 or out.shape[-1] != C or C % out.shape[-2]:
        return False
    R = out.shape[-2]
    mask = _block_lower(C).reshape(C // R, R, C)
    cand = out.reshape(-1, R, C)
    grams = target.reshape(-1, C // R, R, C)
    for p in range(C // R):
        if not mask[p].any():               # rows whose earlier blocks are all elementwise
            continue
        a, b = cand[:, mask[p]], grams[:, p][:, mask[p]]
        close = (a[:, None] - b[None]).abs() <= 1e-10 + 1e-8 * b[None].abs()
        if bool(close.all(-1).any()):
            return True
    return False


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("kind", ["delta_rule", "gdn", "kda", "gdn2"])
def test_backward_never_forms_key_gram(kind, policy):
    q, k, v, g, b, w = _chunk_inputs(kind)
    forbidden = _forbidden_grams(kind)
    h0 = q.new_zeros(q.shape[1], q.shape[2], q.shape[-1], v.shape[-1])

    with ProductRecorder() as fwd:
        o, ht, saved = chunk_forward(q, k, v, g, b, w, h0, 0.25, policy)
    # Positive controls: the forward builds L, so the detector must see it; so must it one chunk's
    # Gram alone, and all chunks' in another batch order.
    assert any(_matches(out, t) for out in fwd.outputs for t in forbidden), \
        "detector failed to find the key Gram in forward"
    kk = forbidden[0]
    one_chunk = kk.reshape(-1, *kk.shape[-2:])[-1]
    assert _matches(one_chunk.clone(), kk) and _matches(kk.transpose(0, 1).contiguous(), kk)
    assert not _matches(one_chunk.transpose(-1, -2) + 1.0, kk)

    with ProductRecorder() as bwd:
        chunk_backward(q, k, v, g, b, w, h0, saved, 0.25, policy, torch.randn_like(o), torch.ones_like(ht))
    assert bwd.outputs, "backward issued no products at all"
    for out in bwd.outputs:
        for target in forbidden:
            assert not _matches(out, target), f"backward formed a key Gram of shape {tuple(out.shape)}"
