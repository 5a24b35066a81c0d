"""The KDA / GDN2 gate activation node (kernels/gate_activation.py): the reference formulas' values and
gradients, and only its raw input kept for the backward."""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.gate_activation import scalar_gate, vector_gate
from rewy_hf.kernels.reference import kda_gate

B, T, H, K = 2, 9, 3, 8
FORMS = {  # (A_log, dt_bias, lower_bound)
    "softplus": (True, True, None),
    "softplus, no bias": (True, False, None),
    "bounded": (True, True, -5.0),
    "bounded, no A": (False, True, -3.0),
}


def _inputs(form, dtype, seed=0):
    has_a, has_bias, lower_bound = FORMS[form]
    gen = torch.Generator().manual_seed(seed)
    g = (3 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    A_log = torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_() if has_a else None
    dt_bias = torch.randn(H * K, generator=gen, dtype=torch.float64).requires_grad_() if has_bias else None
    return g, A_log, dt_bias, lower_bound


@pytest.mark.parametrize("form", FORMS)
def test_float64_gradients_are_exact(form):
    g, A_log, dt_bias, lower_bound = _inputs(form, torch.float64)
    args = [x for x in (g, A_log, dt_bias) if x is not None]

    def f(*xs):
        it = iter(xs)
        return vector_gate(next(it), next(it) if A_log is not None else None,
                           next(it) if dt_bias is not None else None, lower_bound, torch.float64)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("form", FORMS)
def test_bf16_input_matches_the_reference_formulas(form):
    """A bf16 raw gate, float32 math, as FLA's layers call it: values and every gradient equal to
    autograd through ``reference.kda_gate`` on the same float32 values, to float32 rounding."""
    g, A_log, dt_bias, lower_bound = _inputs(form, torch.bfloat16, seed=1)
    params = [None if p is None else p.detach().float().requires_grad_() for p in (A_log, dt_bias)]
    out = vector_gate(g, *params, lower_bound, torch.float32)
    ref_g = g.detach().float().requires_grad_()
    ref_params = [None if p is None else p.detach().clone().requires_grad_() for p in params]
    ref = kda_gate(ref_g, *ref_params, lower_bound)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    live = [x for x in (g, *params) if x is not None]
    ref_live = [x for x in (ref_g, *ref_params) if x is not None]
    grads = torch.autograd.grad((out * dout).sum(), live)
    ref_grads = torch.autograd.grad((ref * dout).sum(), ref_live)
    assert grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0], ref_grads[0].to(torch.bfloat16), rtol=1e-2, atol=1e-3)
    for a, b in zip(grads[1:], ref_grads[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_keeps_only_the_raw_gate_and_its_parameters():
    """Plain torch ops keep a float32 copy of x = g + dt_bias and of softplus(x) (8 bytes per gate
    element); the node keeps g itself (2 bytes per element in bf16) and the two parameters."""
    g, A_log, dt_bias, _ = _inputs("softplus", torch.bfloat16)
    A_log, dt_bias = A_log.detach().float().requires_grad_(), dt_bias.detach().float().requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        vector_gate(g, A_log, dt_bias, None, torch.float32)
    assert {id(t) for t in kept} == {id(g), id(A_log), id(dt_bias)}

    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        kda_gate(g.float(), A_log, dt_bias, None)
    per_element = lambda ts: sum(t.numel() * t.element_size() for t in ts if t.numel() >= g.numel()) / g.numel()  # noqa: E731
    assert per_element(kept) == 2 and per_element(plain) == 8


def test_a_missing_A_log_without_a_bound_is_refused():
    g, _, dt_bias, _ = _inputs("bounded, no A", torch.float32)
    with pytest.raises(ValueError, match="A_log is required"):
        vector_gate(g, None, dt_bias, None, torch.float32)


def test_compiles_whole_with_the_eager_gradients():
    """dynamo traces the node (no graph break): the same values and gradients as eagerly."""
    g, A_log, dt_bias, lower_bound = _inputs("softplus", torch.float32, seed=3)

    def f(g, A_log, dt_bias):
        return vector_gate(g, A_log, dt_bias, lower_bound, torch.float32).square().sum()

    eager = torch.autograd.grad(f(g, A_log, dt_bias), (g, A_log, dt_bias))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for a, b in zip(torch.autograd.grad(compiled(g, A_log, dt_bias), (g, A_log, dt_bias)), eager):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


# GDN's scalar gate per value head: the same node on a channel axis of one.

def _scalar_inputs(dtype, seed=0, HV=4):
    gen = torch.Generator().manual_seed(seed)
    a = (3 * torch.randn(B, T, HV, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    A_log = torch.randn(HV, generator=gen, dtype=torch.float64).requires_grad_()
    dt_bias = torch.randn(HV, generator=gen, dtype=torch.float64).requires_grad_()
    return a, A_log, dt_bias


@pytest.mark.parametrize("with_bias", [True, False])
def test_scalar_gate_float64_gradients_are_exact(with_bias):
    a, A_log, dt_bias = _scalar_inputs(torch.float64)
    args = (a, A_log, dt_bias) if with_bias else (a, A_log)
    assert torch.autograd.gradcheck(
        lambda *xs: scalar_gate(xs[0], xs[1], xs[2] if with_bias else None, torch.float64), args,
        eps=1e-6, atol=1e-9, rtol=1e-7)


def test_scalar_gate_matches_the_qwen35_layers_formula_in_bf16():
    """transformers' Qwen3.5 / Qwen3-Next layer: ``-A_log.float().exp() * softplus(a.float() + dt_bias)``
    on a bf16 projection with float32 parameters. The node's values and gradients equal autograd
    through that formula on the same values, to float32 rounding (a's gradient to one bf16 step)."""
    a, A_log, dt_bias = _scalar_inputs(torch.bfloat16, seed=3)
    A_log, dt_bias = A_log.detach().float().requires_grad_(), dt_bias.detach().float().requires_grad_()
    out = scalar_gate(a, A_log, dt_bias, torch.float32)
    ref_a, ref_A, ref_dt = (x.detach().clone().requires_grad_() for x in (a, A_log, dt_bias))
    ref = -ref_A.float().exp() * torch.nn.functional.softplus(ref_a.float() + ref_dt)
    assert out.dtype == torch.float32 and out.shape == a.shape
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((out * dout).sum(), (a, A_log, dt_bias))
    ref_grads = torch.autograd.grad((ref * dout).sum(), (ref_a, ref_A, ref_dt))
    assert grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=1e-2, atol=1e-3)
    for got, want in zip(grads[1:], ref_grads[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_scalar_gate_keeps_only_the_raw_gate_and_its_parameters():
    a, A_log, dt_bias = _scalar_inputs(torch.bfloat16)
    A_log, dt_bias = A_log.detach().float().requires_grad_(), dt_bias.detach().float().requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        scalar_gate(a, A_log, dt_bias, torch.float32)
    big = [t for t in kept if t.numel() >= a.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16 and big[0].data_ptr() == a.data_ptr()
