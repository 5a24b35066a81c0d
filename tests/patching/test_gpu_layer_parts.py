"""The gated RMSNorm of patched transformers layers on FLA's fused kernel, eagerly on the GPU in
bfloat16: no further from float64 than the module's own torch forward; it and Kimi-Linear's forget
gate counted in the dispatch report once per layer and call, and a patched model's loss and
gradients within bf16 rounding of the same patched model with its parts on their torch forward."""

from __future__ import annotations

import copy

import pytest
import torch

import rewy_hf
from rewy_hf.patching.dispatch import report_difference
from rewy_hf.patching.layer_parts import fused_gated_rms_norm, unbind_layer_parts
from rewy_hf.rel_error import rel_err

import hf_tiny_models as hf

pytestmark = pytest.mark.gpu

FAMILIES = ("qwen3_5", "kimi_linear")


def _model(family: str):
    model = hf.build(hf.family_of(family), dtype=torch.bfloat16)
    return model.cuda()


def _norm_layers(model):
    return [m for m in model.modules() if getattr(m, "_rewy_patch", None) is not None]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_norm_in_bfloat16_is_no_further_from_float64_than_the_torch_one(family):
    model = _model(family)
    rewy_hf.patch_model(model)
    layer = _norm_layers(model)[0]
    norm = next(m for name, m in layer.named_children() if name in ("norm", "o_norm"))
    rewy_hf.unpatch_model(model)
    D = norm.weight.numel()
    gen = torch.Generator(device="cuda").manual_seed(2)
    x64, g64, dy = (torch.randn(4, 333, 8, D, generator=gen, device="cuda", dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=gen, device="cuda"))

    def run(dtype, fn):
        mod = copy.deepcopy(norm).to(dtype)
        x, g = x64.to(dtype).requires_grad_(), g64.to(dtype).requires_grad_()
        out = fn(mod, x, g)
        return [out.double(), *(t.double() for t in torch.autograd.grad(out, (x, g, mod.weight), dy.to(dtype)))]

    own = lambda mod, x, g: type(mod).forward(mod, x, g)  # noqa: E731
    ref = run(torch.float64, own)
    torch_bf16, fused_bf16 = run(torch.bfloat16, own), run(torch.bfloat16, fused_gated_rms_norm)
    for name, f, t, r in zip(("y", "dx", "dgate", "dweight"), fused_bf16, torch_bf16, ref):
        assert rel_err(f, r) <= 1.1 * rel_err(t, r) + 1e-6, (name, rel_err(f, r), rel_err(t, r))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_patched_model_runs_its_norms_on_the_fused_kernel(family):
    # The reference is the same patched model with its parts on their own torch forward: it runs
    # rewy's core too, so only the parts differ (an unpatched Qwen3.5 cannot be the reference on
    # Hopper with Triton < 3.7.1, where FLA refuses its GDN backward).
    model = _model(family)
    twin = copy.deepcopy(model)
    ids = torch.randint(3, hf.VOCAB, (2, 300), generator=torch.Generator().manual_seed(4)).cuda()

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().float(), torch.cat([p.grad.flatten().float() for p in m.parameters()
                                                 if p.grad is not None])

    rewy_hf.patch_model(twin)
    for layer in _norm_layers(twin):
        unbind_layer_parts(layer, layer._rewy_patch.parts)
    before = rewy_hf.dispatch_report()
    ref_loss, ref_grads = loss_and_grads(twin)
    assert not {"gated_norm", "forget_gate"} & set(report_difference(before, rewy_hf.dispatch_report())["ops"])
    layers = len(rewy_hf.patch_model(model).patched)
    before = rewy_hf.dispatch_report()
    loss, grads = loss_and_grads(model)
    ops = report_difference(before, rewy_hf.dispatch_report())["ops"]
    assert ops["gated_norm"]["forward_calls"] == layers > 0
    if family == "kimi_linear":
        assert ops["forget_gate"]["forward_calls"] == layers
    assert rel_err(loss, ref_loss) < 1e-2 and rel_err(grads, ref_grads) < 5e-2
    rewy_hf.unpatch_model(model)
    before = rewy_hf.dispatch_report()
    model(input_ids=ids)
    assert not {"gated_norm", "forget_gate"} & set(report_difference(before, rewy_hf.dispatch_report())["ops"])
