"""The parts of a patched transformers layer around its core that rewy runs in its own form: FLA's
fused kernel (run here by Triton's interpreter) computes each model's gated norm, rewy's one-node
gate activation computes Kimi-Linear's forget gate keeping less for the backward, and patching binds
and unbinds both per instance (they run in rewy's form for eager CUDA calls only) without touching the weights, leaving alone a module whose forward is
someone else's."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import rewy_hf
from rewy_hf.models.presets import build_preset
from rewy_hf.patching.layer_parts import RoutedForward, forget_gate, fused_gated_rms_norm, layer_parts
from rewy_hf.rel_error import rel_err

# (preset, the module holding the norm, its attribute): SiLU gates with the normalised value
# rounded before the weight (the Qwen family), SiLU with a float32 weight product, a sigmoid gate.
PRESETS = [("tiny-qwen3.5", "linear_attn", "norm"), ("tiny-qwen3.5-moe", "linear_attn", "norm"),
           ("tiny-qwen3-next", "linear_attn", "norm"), ("tiny-olmo-hybrid", "linear_attn", "o_norm"),
           ("tiny-kimi-linear", "self_attn", "o_norm")]


def _first_norm(model, holder: str, attr: str):
    layer = next(m for name, m in model.named_modules() if name.endswith(holder) and hasattr(m, attr))
    return layer, getattr(layer, attr)


@pytest.mark.parametrize("preset,holder,attr", PRESETS, ids=[p[0] for p in PRESETS])
def test_the_fused_kernel_computes_each_models_gated_norm(preset, holder, attr):
    """float32 through the fused kernel against the module's own forward in float64: the value and
    the gradients of the input, the gate and the weight."""
    _, norm = _first_norm(build_preset(preset), holder, attr)
    D = norm.weight.numel()
    gen = torch.Generator().manual_seed(3)
    x64, g64 = (torch.randn(2, 37, 3, D, generator=gen, dtype=torch.float64) for _ in range(2))
    dy = torch.randn(2, 37, 3, D, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=gen))

    def run(dtype, fn):
        mod = copy.deepcopy(norm).to(dtype)
        x, g = x64.to(dtype).requires_grad_(), g64.to(dtype).requires_grad_()
        out = fn(mod, x, g)
        grads = torch.autograd.grad(out, (x, g, mod.weight), dy.to(dtype))
        return [out.double(), *(t.double() for t in grads)]

    ref = run(torch.float64, lambda mod, x, g: type(mod).forward(mod, x, g))
    got = run(torch.float32, fused_gated_rms_norm)
    for name, a, r in zip(("y", "dx", "dgate", "dweight"), got, ref):
        assert a.shape == r.shape and rel_err(a, r) <= 1e-5, (name, rel_err(a, r))


def test_patching_binds_each_layers_norm_and_unpatching_restores_it():
    model = build_preset("tiny-qwen3.5")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = rewy_hf.patch_model(model)
    norms = [m.norm for name, m in model.named_modules() if name.endswith("linear_attn")]
    assert len(norms) == len(report.patched) > 0
    assert all(isinstance(n.__dict__.get("forward"), RoutedForward) and n.forward.module is n for n in norms)
    twin = copy.deepcopy(model)        # a copy's norms route through their own module, not the original's
    assert all(t.forward.module is t for name, m in twin.named_modules() if name.endswith("linear_attn")
               for t in [m.norm])
    saved = io.BytesIO()               # and so do those of a pickled model (torch.save of the whole module)
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert all(isinstance(t.__dict__.get("forward"), RoutedForward) and t.forward.module is t
               for name, m in loaded.named_modules() if name.endswith("linear_attn") for t in [m.norm])
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    rewy_hf.reset_dispatch_report()
    model(input_ids=ids)
    # on the CPU the norm runs its own torch forward: the fused kernel serves CUDA only
    assert "gated_norm" not in rewy_hf.dispatch_report()["ops"]
    assert rewy_hf.unpatch_model(model) == len(norms) and rewy_hf.unpatch_model(twin) == len(norms)
    assert all("forward" not in n.__dict__ for n in norms)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and state.keys() == \
        model.state_dict().keys()


def test_a_norm_whose_forward_is_not_its_own_is_left_alone(monkeypatch):
    """An instance-level forward of someone else (Accelerate's device hooks set one) and a class
    forward from elsewhere (``kernelize`` maps hub kernels onto the class) both stay as they are."""
    model = build_preset("tiny-qwen3.5")
    layer = next(m for name, m in model.named_modules() if name.endswith("linear_attn"))
    theirs = layer.norm.forward = lambda hidden_states, gate=None: hidden_states
    assert rewy_hf.patch_model(model).patched
    assert layer.norm.forward is theirs
    rewy_hf.unpatch_model(model)
    assert layer.norm.__dict__["forward"] is theirs

    def hub_forward(self, hidden_states, gate=None):
        return hidden_states

    del layer.norm.forward
    assert [(name, child) for name, child, _ in layer_parts(layer)] == [("norm", layer.norm)]
    monkeypatch.setattr(type(layer.norm), "forward", hub_forward)
    assert not layer_parts(layer)
    assert rewy_hf.patch_model(model).patched
    assert "forward" not in layer.norm.__dict__
    rewy_hf.unpatch_model(model)


def _kimi_gate():
    layer = next(m for name, m in build_preset("tiny-kimi-linear").named_modules() if name.endswith("self_attn")
                 and hasattr(m, "forget_gate"))
    return layer, layer.forget_gate


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``fn`` runs."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_kimis_forget_gate_as_one_node_gives_its_values_and_keeps_a_third():
    _, gate = _kimi_gate()
    with torch.no_grad():
        gate.dt_bias.uniform_(-6, 3, generator=torch.Generator().manual_seed(1))   # softplus on both sides of 0
    x = torch.randn(2, 64, gate.f_a_proj.in_features, generator=torch.Generator().manual_seed(2)).requires_grad_()
    params = [x, gate.f_a_proj.weight, gate.f_b_proj.weight, gate.dt_bias, gate.A_log]

    def run(fn):
        out = fn()
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        return [out, *torch.autograd.grad(out, params, dout)]

    own, ours = run(lambda: type(gate).forward(gate, x)), run(lambda: forget_gate(gate, x))
    for name, a, r in zip(("g", "dx", "dW_a", "dW_b", "ddt_bias", "dA_log"), ours, own):
        assert a.dtype == r.dtype == torch.float32 and a.shape == r.shape
        assert rel_err(a, r) <= 1e-6, (name, rel_err(a, r))
    # what the activation keeps, past what the two projections keep for their own backward
    projections = _saved_bytes(lambda: gate.f_b_proj(gate.f_a_proj(x)))
    mine = _saved_bytes(lambda: forget_gate(gate, x)) - projections
    theirs = _saved_bytes(lambda: type(gate).forward(gate, x)) - projections
    assert 0 < mine * 3 <= theirs, (mine, theirs)


def test_patching_binds_kimis_forget_gate_and_the_cpu_runs_its_own_forward():
    model = build_preset("tiny-kimi-linear")
    report = rewy_hf.patch_model(model)
    gates = [m.forget_gate for m in model.modules() if hasattr(m, "forget_gate")]
    assert len(gates) == len(report.patched) > 0
    assert all(isinstance(g.__dict__.get("forward"), RoutedForward) for g in gates)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    rewy_hf.reset_dispatch_report()
    model(input_ids=ids, labels=ids).loss.backward()
    assert "forget_gate" not in rewy_hf.dispatch_report()["ops"]
    rewy_hf.unpatch_model(model)
    assert all("forward" not in g.__dict__ for g in gates)
