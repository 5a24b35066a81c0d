"""The fused form of the layers' short causal convolution (kernels/short_conv.py) against
transformers' ``F.conv1d`` statement of it, in float64: values and the gradients of input,
weight and bias, with and without the activation; the packed convolution, eager and compiled
forms, against the documents run one by one; FLA's Triton convolution that eager CUDA calls take
(here under Triton's interpreter), packed and not; and the shapes it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from rewy_hf.kernels.short_conv import causal_short_conv, packed_causal_short_conv, triton_short_conv
from rewy_hf.rel_error import rel_err


def conv1d_statement(x, weight, bias, activation):
    """transformers' torch path of ``causal_conv1d_fn``."""
    T, W = x.shape[-1], weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=W - 1, groups=x.shape[1])[..., :T]
    return out if activation is None else ACT2FN[activation](out)


@pytest.mark.parametrize("activation,with_bias,T", [("silu", False, 37), (None, True, 5), ("silu", True, 2)])
def test_matches_the_conv1d_statement_in_float64(activation, with_bias, T):
    gen = torch.Generator().manual_seed(7)
    B, C, W = 2, 6, 4
    x = torch.randn(B, C, T, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(C, generator=gen, dtype=torch.float64, requires_grad=True) if with_bias else None
    leaves = [x, weight] + ([bias] if with_bias else [])
    dy = torch.randn(B, C, T, generator=gen, dtype=torch.float64)

    ref = conv1d_statement(x, weight, bias, activation)
    ref_grads = torch.autograd.grad((ref * dy).sum(), leaves)
    out = causal_short_conv(x, weight, bias, activation)
    grads = torch.autograd.grad((out * dy).sum(), leaves)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-12
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 1e-12


def test_bfloat16_input_rounds_once():
    """On 16-bit inputs the sum and the activation run in float32 and round once at the end, so the
    result is within one rounding of the float64 value (the conv1d statement rounds twice)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 8, 50, generator=gen).bfloat16()
    weight = torch.randn(8, 4, generator=gen).bfloat16()
    out = causal_short_conv(x, weight, None, "silu")
    exact = conv1d_statement(x.double(), weight.double(), None, "silu")
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30).all()


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \[B, C, T\] and weight \[C, W\]"):
        causal_short_conv(torch.zeros(2, 6, 10), torch.zeros(5, 4))


# documents of 1, 2 and 3 tokens (shorter than the width: their outputs sit within W - 1 of two
# bounds), a bound right after position 0, and longer ones
PACKED = (1, 9, 2, 3, 1, 20, 7)


@pytest.mark.parametrize("activation,with_bias", [("silu", True), (None, False)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_packed_row_equals_its_documents_in_float64(activation, with_bias, compiled):
    """Eagerly the row runs through F.conv1d and the outputs within W - 1 after each bound are
    recomputed; compiled, every tap is masked. Both give each document its own convolution."""
    gen = torch.Generator().manual_seed(9)
    C, W, T = 5, 4, sum(PACKED)
    x = torch.randn(1, C, T, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(C, generator=gen, dtype=torch.float64, requires_grad=True) if with_bias else None
    leaves = [x, weight] + ([bias] if with_bias else [])
    dy = torch.randn(1, C, T, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()], dtype=torch.int32)

    docs = [conv1d_statement(part, weight, bias, activation) for part in x.split(list(PACKED), dim=-1)]
    ref = torch.cat(docs, dim=-1)
    ref_grads = torch.autograd.grad((ref * dy).sum(), leaves)
    conv = torch.compile(packed_causal_short_conv, backend="aot_eager", fullgraph=True) if compiled \
        else packed_causal_short_conv
    out = conv(x, weight, bias, activation, cu)
    grads = torch.autograd.grad((out * dy).sum(), leaves)
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-12
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 1e-12
    whole = conv1d_statement(x, weight, bias, activation)
    assert rel_err(whole, ref) > 1e-2                 # the row run as one document would differ


@pytest.mark.parametrize("activation,with_bias", [("silu", True), (None, False)])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_triton_convolution_matches_float64(activation, with_bias, packed):
    """float32 through FLA's kernel against the documents (or rows) in float64: values and the
    gradients of input, weight and bias, from the transposed view transformers passes."""
    gen = torch.Generator().manual_seed(10)
    C, W = 16, 4
    B, T = (1, sum(PACKED)) if packed else (2, 29)
    x64 = torch.randn(B, T, C, generator=gen, dtype=torch.float64).transpose(1, 2)
    w64, b64 = torch.randn(C, W, generator=gen, dtype=torch.float64), torch.randn(C, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, C, T, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()], dtype=torch.int32) if packed else None

    def run(dtype, conv):
        leaves = [x64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()]
        leaves += [b64.to(dtype).requires_grad_()] if with_bias else []
        out = conv(leaves[0], leaves[1], leaves[2] if with_bias else None)
        grads = torch.autograd.grad((out * dy.to(dtype)).sum(), leaves)
        return [out.double(), *(g.double() for g in grads)]

    def reference(x, w, b):
        if not packed:
            return conv1d_statement(x, w, b, activation)
        return torch.cat([conv1d_statement(p, w, b, activation) for p in x.split(list(PACKED), -1)], -1)

    ref = run(torch.float64, reference)
    kernels = []

    def fla(x, w, b):
        out, which = triton_short_conv(x, w, b, activation, cu)
        kernels.append(which)
        return out

    got = run(torch.float32, fla)
    assert kernels == ["fla-triton"]        # FLA's Gluon kernels need an NVIDIA GPU
    assert got[0].shape == ref[0].shape
    for a, r in zip(got, ref):
        assert rel_err(a, r) <= 1e-5, rel_err(a, r)


def test_triton_convolution_refuses_a_packed_batch():
    with pytest.raises(ValueError, match="one row"):
        triton_short_conv(torch.zeros(2, 4, 10), torch.zeros(4, 4), None, None, torch.tensor([0, 4, 10]))
