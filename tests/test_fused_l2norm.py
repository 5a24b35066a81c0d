"""The triton backends' q/k l2norm (FLA's fused kernel, under the interpreter on CPU).

It must compute FLA's l2norm (float64 ground truth for values and gradients)
and keep no float32 copy of q or k for backward: that copy, per layer, is what
made a patched Qwen3.5 step slower and larger than the unpatched one.
"""

from __future__ import annotations

import torch

from rewy_hf.kernels.reference import l2norm
from rewy_hf.ops import _prepare_qk


def _inputs(seed=0, shape=(2, 37, 3, 64)):
    gen = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(*shape, generator=gen)).half().requires_grad_() for _ in range(2)]


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_fused_l2norm_matches_float64_values_and_gradients():
    q, k = _inputs()
    dq_out, dk_out = torch.randn(q.shape, dtype=torch.float64), torch.randn(k.shape, dtype=torch.float64)
    qn, kn = _prepare_qk(q, k, True, keep_dtype=True)
    assert qn.dtype == kn.dtype == torch.float16
    ((qn.double() * dq_out).sum() + (kn.double() * dk_out).sum()).backward()

    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    qr, kr = l2norm(q64), l2norm(k64)
    ((qr * dq_out).sum() + (kr * dk_out).sum()).backward()

    # float16 output rounding (2^-11 relative) bounds both the values and,
    # since FLA's backward reads the rounded output, the gradients
    for ours, ref in ((qn, qr), (kn, kr), (q.grad, q64.grad), (k.grad, k64.grad)):
        assert _rel(ours, ref.detach()) < 2e-3


def test_fused_l2norm_keeps_no_float32_copy_of_q_or_k():
    q, k = _inputs(seed=1)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        qn, kn = _prepare_qk(q, k, True, keep_dtype=True)
    assert saved, "the fused l2norm saved nothing for backward"
    full_size_fp32 = [s for s in saved if s == (torch.float32, q.numel())]
    assert not full_size_fp32, saved
    # what it does keep: its half-precision outputs and one float32 norm per row
    assert sum(n for dt, n in saved if dt == torch.float32) == 2 * q.numel() // q.shape[-1]
