"""GDN2's FLA blocks on the CPU (models/gdn2/cpu_modules.py): each torch form gives its FLA module's
outputs and gradients (FLA's kernels in the Triton interpreter), FLA's own forward serves every call
a form does not cover, and a GDN2 model carries FLA's parameters unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from fla.modules import FusedRMSNormGated, GatedMLP, ShortConvolution

from rewy_hf.models.gdn2 import GDN2ForCausalLM, gdn2_config
from rewy_hf.models.gdn2.cpu_modules import (CpuTorchGatedMLP, CpuTorchRMSNormGated, CpuTorchShortConvolution,
                                             use_torch_forms_on_cpu)


def _pair(module: torch.nn.Module):
    """FLA's module and its CPU form, with the same (perturbed) parameters."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = copy.deepcopy(module)
    use_torch_forms_on_cpu(ours)
    assert type(ours) is not type(module)
    return module, ours


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _same_values_and_gradients(fla, ours, inputs: list[torch.Tensor], call, tol=1e-5):
    torch.manual_seed(1)
    results = []
    for module in (fla, ours):
        leaves = [x.clone().requires_grad_() for x in inputs]
        y = call(module, *[x.clone() for x in leaves])       # FLA's convolution scales its input in place
        do = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        results.append((y, *torch.autograd.grad((y * do).sum(), [*leaves, *module.parameters()])))
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert _rel(a, b) <= tol, f"output {i} of {type(ours).__name__}: {_rel(a, b):.2e}"


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_short_convolution(activation, bias, masked):
    fla, ours = _pair(ShortConvolution(hidden_size=24, kernel_size=4, bias=bias, activation=activation))
    assert type(ours) is CpuTorchShortConvolution
    mask = (torch.arange(37) < torch.tensor([[37], [20]])).float() if masked else None
    _same_values_and_gradients(fla, ours, [torch.randn(2, 37, 24)], lambda m, x: m(x, mask=mask)[0])


@pytest.mark.parametrize("activation", ["sigmoid", "swish"])
def test_gated_norm(activation):
    fla, ours = _pair(FusedRMSNormGated(16, activation=activation, eps=1e-5))
    assert type(ours) is CpuTorchRMSNormGated
    _same_values_and_gradients(fla, ours, [torch.randn(3, 11, 16), torch.randn(3, 11, 16)], lambda m, x, g: m(x, g))


@pytest.mark.parametrize("fuse_swiglu", [False, True])
def test_gated_mlp(fuse_swiglu):
    fla, ours = _pair(GatedMLP(hidden_size=32, intermediate_size=48, hidden_act="swish", fuse_swiglu=fuse_swiglu))
    assert type(ours) is CpuTorchGatedMLP
    _same_values_and_gradients(fla, ours, [torch.randn(2, 9, 32)], lambda m, x: m(x))


@pytest.mark.parametrize("call", [dict(output_final_state=True), dict(cache=torch.zeros(1, 24, 4)),
                                  dict(cu_seqlens=torch.tensor([0, 5, 12])), dict(residual=torch.zeros(1, 12, 24))])
def test_other_convolution_calls_run_flas_forward(monkeypatch, call):
    _, ours = _pair(ShortConvolution(hidden_size=24, kernel_size=4))
    seen = []
    monkeypatch.setattr(ShortConvolution, "forward", lambda self, x, **kw: seen.append(sorted(kw)) or (x, None))
    ours(torch.randn(1, 12, 24), **call)
    assert seen and set(call) <= set(seen[0])


def test_gated_norm_with_a_residual_runs_flas_forward(monkeypatch):
    _, ours = _pair(FusedRMSNormGated(16, activation="sigmoid"))
    seen = []
    monkeypatch.setattr(FusedRMSNormGated, "forward", lambda self, x, g, **kw: seen.append(kw) or x)
    ours(torch.randn(2, 16), torch.randn(2, 16), residual=torch.zeros(2, 16))
    assert seen and seen[0]["residual"] is not None


def test_gdn2_model_uses_them_with_flas_parameter_names():
    torch.manual_seed(0)
    model = GDN2ForCausalLM(gdn2_config("tiny"))
    forms = {type(m) for m in model.modules()}
    assert {CpuTorchShortConvolution, CpuTorchRMSNormGated, CpuTorchGatedMLP} <= forms
    assert not forms & {ShortConvolution, FusedRMSNormGated, GatedMLP}
    names = {n.split("layers.0.")[-1] for n, _ in model.named_parameters() if "layers.0." in n}
    assert {"attn.q_conv1d.weight", "attn.o_norm.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight"} <= names
