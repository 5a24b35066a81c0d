"""GDN2's short convolutions on the CPU (models/gdn2/cpu_conv.py): the torch form gives FLA's
convolution's outputs and gradients, FLA's own forward serves every call the torch form does not
cover, and a GDN2 model carries FLA's parameters unchanged."""

from __future__ import annotations

import pytest
import torch
from fla.modules import ShortConvolution

from rewy_hf.models.gdn2 import GDN2ForCausalLM, gdn2_config
from rewy_hf.models.gdn2.cpu_conv import CpuTorchShortConvolution, use_torch_convolutions_on_cpu


def _pair(activation, bias):
    torch.manual_seed(0)
    fla = ShortConvolution(hidden_size=24, kernel_size=4, bias=bias, activation=activation)
    ours = ShortConvolution(hidden_size=24, kernel_size=4, bias=bias, activation=activation)
    ours.load_state_dict(fla.state_dict())
    use_torch_convolutions_on_cpu(ours)
    assert type(ours) is CpuTorchShortConvolution
    return fla, ours


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_torch_form_gives_flas_outputs_and_gradients(activation, bias, masked):
    fla, ours = _pair(activation, bias)
    x = torch.randn(2, 37, 24)
    mask = (torch.arange(37) < torch.tensor([[37], [20]])).float() if masked else None
    do = torch.randn(2, 37, 24)
    results = []
    for conv in (fla, ours):
        xi = x.clone().requires_grad_()
        y, state = conv(xi.clone(), mask=mask)        # FLA's forward scales its input in place by the mask
        assert state is None
        grads = torch.autograd.grad((y * do).sum(), [xi, *conv.parameters()])
        results.append((y, *grads))
    for name, a, b in zip(["y", "dx", "dweight", "dbias"], results[1], results[0]):
        assert _rel(a, b) <= 1e-5, f"{name}: {_rel(a, b):.2e}"


@pytest.mark.parametrize("call", [dict(output_final_state=True), dict(cache=torch.zeros(1, 24, 4)),
                                  dict(cu_seqlens=torch.tensor([0, 5, 12])), dict(residual=torch.zeros(1, 12, 24))])
def test_other_calls_run_flas_forward(monkeypatch, call):
    _, ours = _pair("silu", False)
    seen = []
    monkeypatch.setattr(ShortConvolution, "forward", lambda self, x, **kw: seen.append(sorted(kw)) or (x, None))
    ours(torch.randn(1, 12, 24), **call)
    assert seen and set(call) <= set(seen[0])


def test_gdn2_model_uses_it_with_flas_parameter_names():
    torch.manual_seed(0)
    model = GDN2ForCausalLM(gdn2_config("tiny"))
    convs = [m for m in model.modules() if isinstance(m, ShortConvolution)]
    assert convs and all(type(m) is CpuTorchShortConvolution for m in convs)
    names = [n for n, _ in model.named_parameters() if "conv1d" in n]
    assert names and all(n.endswith("conv1d.weight") or n.endswith("conv1d.bias") for n in names)
