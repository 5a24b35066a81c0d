"""patch_model on tiny random transformers models of all 9 supported families (CPU).

The unpatched reference always runs transformers' own plain-torch core
(``reference_core``): with FLA installed, the hub wrapper would call FLA's
Triton op, which cannot run on CPU. Sequences are B=2, T=70 (one full chunk
of 64 plus a ragged tail) and the gates are initialised so that the state
really crosses the chunk boundary (see hf_tiny_models._init_gates).
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import re

import pytest
import torch
import torch.nn as nn

from rewy_hf import UnsupportedConfigError, dispatch_report, is_patched, patch_model, patched, reset_dispatch_report
from rewy_hf import unpatch_model
from rewy_hf.adapters.transformers_common import torch_reference
from rewy_hf.patching.dispatch import CoreDispatcher
from rewy_hf.rel_error import rel_err

import hf_tiny_models as H

T = 70
FAMILIES = list(H.FAMILIES)
ONE_PER_OP = ["qwen3_5", "kimi_linear"]


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    yield
    logging.set_verbosity(level)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train_step(model, family, ids):
    loss = H.loss_of(model, ids, family)
    loss.backward()
    return loss.detach(), grads(model)


def layers_of(model, family) -> list[nn.Module]:
    cls = H.FAMILIES[family].layer_class
    return [m for m in model.modules() if type(m).__name__ == cls]


def site_value(family):
    fam = H.FAMILIES[family]
    return getattr(fam.modeling, fam.site_attr)


def op_counts(op: str) -> dict:
    return dispatch_report()["ops"].get(op, {"forward_calls": 0, "optimized_backward_calls": 0, "fallback_calls": 0})


# ---------------------------------------------------------------------------
# 1. Parity, per family
# ---------------------------------------------------------------------------

@functools.cache
def _runs(family: str) -> dict:
    """One training step of each model the parity tests compare, shared by them."""
    fam = H.FAMILIES[family]
    base = H.build(family)
    ids = H.input_ids(2, T)
    out = {"names": H.delta_rule_layer_names(base, family)}

    # float64 truth: rewy's token-by-token reference as the core, transformers' call convention
    truth = H.twin(base).double()
    with H.float64_reference_core(family):
        out["loss64"], out["g64"] = train_step(truth, family, ids)

    # float64, patched
    p64 = H.twin(base).double()
    patch_model(p64)
    try:
        out["loss64_rewy"], out["g64_rewy"] = train_step(p64, family, ids)
    finally:
        unpatch_model(p64)

    # float32, transformers' own plain-torch core
    hf = H.twin(base)
    with H.reference_core(family):
        out["loss32_hf"], out["g32_hf"] = train_step(hf, family, ids)

    # float32, patched (a reference_core is active too, as an unpatched model would need it)
    p32 = H.twin(base)
    out["report"] = patch_model(p32)
    try:
        reset_dispatch_report()
        with H.reference_core(family):
            out["loss32_rewy"], out["g32_rewy"] = train_step(p32, family, ids)
        out["dispatch"] = dispatch_report()
    finally:
        unpatch_model(p32)
    out["op"] = fam.op
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_float64(family):
    r = _runs(family)
    loss_err = rel_err(r["loss64_rewy"], r["loss64"])
    assert r["loss64"].dtype == torch.float64
    assert loss_err <= 1e-9, f"{family}: float64 loss rel err {loss_err:.2e}"
    assert set(r["g64_rewy"]) == set(r["g64"]), "the same parameters must receive gradients"
    errs = {n: rel_err(r["g64_rewy"][n], g) for n, g in r["g64"].items()}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    print(f"\n{family}: float64 loss rel {loss_err:.2e}; worst grad rel {worst[0][1]:.2e} ({worst[0][0]})")
    assert max(errs.values()) <= 1e-9, f"{family}: float64 gradient rel errors, worst: {worst}"
    # the delta-rule layers' own parameters are among those compared
    for name in r["names"]:
        assert any(n.startswith(name + ".") for n in errs), name


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_float32(family):
    r = _runs(family)
    loss_err = rel_err(r["loss32_rewy"], r["loss32_hf"])
    assert loss_err <= 1e-5, f"{family}: float32 loss rel err vs transformers' core {loss_err:.2e}"
    assert set(r["g32_rewy"]) == set(r["g32_hf"]) == set(r["g64"])
    rows = []   # (ours vs float64 truth, transformers vs float64 truth, name)
    for n, truth in r["g64"].items():
        rows.append((rel_err(r["g32_rewy"][n], truth), rel_err(r["g32_hf"][n], truth), n))
    # A parameter whose true gradient nearly cancels (glm5_next's 3-element attn_hc.scale: 5e-6
    # of the model's gradient norm) has a relative float32 error set by rounding noise, which
    # moves with the CPU's arithmetic (7.5e-5 for rewy against 3.4e-5 for transformers on one
    # machine, the other way round for layers.1.ffn_hc.scale). Such a parameter (true gradient
    # under 1e-5 of the model's) is held to an absolute bound instead: 1e-8 of the model's
    # gradient norm, 25x the largest such error measured (4e-10, glm5_next; 4e-12 in qwen4_exp)
    # and 1000x below a gross error (relative error near 1) in such a parameter.
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in r["g64"].values())).item()
    near_zero = {n for n, g in r["g64"].items() if g.double().norm().item() < 1e-5 * total}
    abs_err = {n: (r["g32_rewy"][n].double() - r["g64"][n].double()).norm().item() / total for n in near_zero}
    assert all(e <= 1e-8 for e in abs_err.values()), f"{family}: near-zero gradients, error / model norm: {abs_err}"
    bad = [(o, t, n) for o, t, n in rows if o > max(2 * t, 1e-5) and n not in near_zero]
    worst_ours = max(rows)
    worst_hf = max(rows, key=lambda x: x[1])
    worst_ratio = max(rows, key=lambda x: x[0] / max(x[1], 1e-12))
    summary = (f"{family}: loss rel {loss_err:.2e}; worst grad error ours {worst_ours[0]:.2e} ({worst_ours[2]}; "
               f"transformers {worst_ours[1]:.2e}), worst transformers {worst_hf[1]:.2e} ({worst_hf[2]}), "
               f"worst ratio ours/transformers {worst_ratio[0] / max(worst_ratio[1], 1e-12):.2f} ({worst_ratio[2]})")
    print("\n" + summary)
    assert not bad, summary + "; over max(2 x transformers, 1e-5): " + "; ".join(
        f"{n}: ours {o:.2e} vs transformers {t:.2e}" for o, t, n in sorted(bad, reverse=True)[:8])


@pytest.mark.parametrize("family", FAMILIES)
def test_report_and_dispatch_counts(family):
    r = _runs(family)
    report, names, op = r["report"], r["names"], r["op"]
    assert len(names) == 2, f"the tiny {family} config should have two delta-rule layers, found {names}"
    assert [p.name for p in report.patched] == names
    assert report.skipped == []
    layer_class = H.FAMILIES[family].layer_class
    for p in report.patched:
        assert (p.layer_class, p.op, p.backend, p.policy, p.already) == (layer_class, op, "auto", "recompute", False)
    assert (report.backend, report.policy, report.fallback) == ("auto", "recompute", "error")
    ops = r["dispatch"]["ops"]
    assert set(ops) == {op}, ops
    e = ops[op]
    assert (e["forward_calls"], e["optimized_backward_calls"], e["fallback_calls"]) == (len(names), len(names), 0), e
    assert e["backends"] == {"torch": len(names)} and e["policies"] == {"recompute": len(names)}
    json.dumps(r["dispatch"])


# ---------------------------------------------------------------------------
# 2. Instance scoping and unpatch
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ONE_PER_OP)
def test_dropped_patched_model_releases_the_site(family):
    """A patched model deleted without unpatch_model: once it is collected, the module-level
    core is the original again (no dispatcher left on every later call)."""
    gc.collect()
    original = site_value(family)
    assert not isinstance(original, CoreDispatcher), "a live patched instance from elsewhere"
    a = H.build(family)
    patch_model(a)
    assert isinstance(site_value(family), CoreDispatcher)
    del a
    gc.collect()                 # patched layers hold themselves in a cycle (layer -> forward -> layer)
    assert site_value(family) is original


@pytest.mark.parametrize("family", ONE_PER_OP)
def test_instance_scoping_and_unpatch(family):
    fam = H.FAMILIES[family]
    gc.collect()                 # models dropped by earlier tests without unpatch release their site here
    original = site_value(family)
    assert not isinstance(original, CoreDispatcher), "a previous test left a live patched instance behind"
    ids = H.input_ids(2, T)
    a = H.build(family)
    b = H.twin(a)
    n = len(layers_of(a, family))
    report = patch_model(a)
    try:
        assert len(report) == n
        assert isinstance(site_value(family), CoreDispatcher)
        assert all(is_patched(m) for m in layers_of(a, family))
        assert not any(is_patched(m) for m in layers_of(b, family))

        reset_dispatch_report()
        with H.reference_core(family), torch.no_grad():
            loss_b = H.loss_of(b, ids, family)
        assert dispatch_report()["ops"] == {}, "the unpatched model must not reach rewy"
        with H.reference_core(family), torch.no_grad():
            loss_a = H.loss_of(a, ids, family)
        assert op_counts(fam.op)["forward_calls"] == n
        assert rel_err(loss_a, loss_b) <= 1e-5

        # a second patched instance keeps the dispatcher installed after the first is unpatched
        patch_model(b)
        assert unpatch_model(a) == n
        assert isinstance(site_value(family), CoreDispatcher)
        for layer in layers_of(a, family):
            assert "forward" not in layer.__dict__ and "_rewy_patch" not in layer.__dict__
            assert not is_patched(layer)
        reset_dispatch_report()
        with H.reference_core(family), torch.no_grad():
            H.loss_of(a, ids, family)
        assert dispatch_report()["ops"] == {}, "an unpatched model must no longer reach rewy"
        with H.reference_core(family), torch.no_grad():
            H.loss_of(b, ids, family)
        assert op_counts(fam.op)["forward_calls"] == n
    finally:
        unpatch_model(a)
        unpatch_model(b)
    assert site_value(family) is original, "no patched instance remains: the module global must be restored"
    assert unpatch_model(a) == 0


def test_deepcopy_of_patched_model_is_scoped():
    """copy.deepcopy of a patched model (a reference/EMA model) is a patched instance
    of its own: unpatching the copy must leave the original routed to rewy."""
    family = "qwen3_5"
    original = site_value(family)
    ids = H.input_ids(2, T)
    a = H.build(family)
    n = len(layers_of(a, family))
    patch_model(a)
    c = copy.deepcopy(a)
    try:
        assert all(is_patched(m) for m in layers_of(c, family))
        for layer in layers_of(c, family):
            assert layer.forward.__self__ is layer, "the copy's wrapper must be bound to the copy"
        unpatch_model(c)
        reset_dispatch_report()
        with H.reference_core(family), torch.no_grad():
            H.loss_of(a, ids, family)
        assert op_counts("gated_delta_rule")["forward_calls"] == n, (
            "after unpatching a deep copy, the still-patched original no longer reaches rewy "
            f"(module global is now {site_value(family)!r})")
    finally:
        unpatch_model(c)
        unpatch_model(a)
        # leave the module as found, whatever the outcome above
        fam = H.FAMILIES[family]
        if isinstance(site_value(family), CoreDispatcher):
            setattr(fam.modeling, fam.site_attr, original)
    assert site_value(family) is original


# ---------------------------------------------------------------------------
# 3. Idempotency and the patched() context manager
# ---------------------------------------------------------------------------

def test_patch_twice_is_idempotent():
    family = "qwen3_5"
    original = site_value(family)
    ids = H.input_ids(2, T)
    m = H.build(family)
    layers = layers_of(m, family)
    first = patch_model(m)
    try:
        states = [layer.__dict__["_rewy_patch"] for layer in layers]
        hooks = [(dict(layer._forward_pre_hooks), dict(layer._forward_hooks)) for layer in layers]
        second = patch_model(m)
        assert [p.name for p in second.patched] == [p.name for p in first.patched]
        assert all(p.already for p in second.patched) and not any(p.already for p in first.patched)
        assert "(already)" in str(second)
        for layer, state, (pre, post) in zip(layers, states, hooks):
            assert layer.__dict__["_rewy_patch"] is state
            assert (dict(layer._forward_pre_hooks), dict(layer._forward_hooks)) == (pre, post), \
                "a second patch must not add hooks"
        reset_dispatch_report()
        with H.reference_core(family), torch.no_grad():
            H.loss_of(m, ids, family)
        assert op_counts("gated_delta_rule")["forward_calls"] == len(layers)
        assert unpatch_model(m) == len(layers)
        assert site_value(family) is original, "one unpatch undoes a double patch"
    finally:
        unpatch_model(m)


def test_patched_context_manager():
    family = "qwen3_5"
    original = site_value(family)
    ids = H.input_ids(2, T)
    m = H.build(family)
    layers = layers_of(m, family)
    assert len(layers) == 2
    with patched(m) as report:
        assert all(is_patched(layer) for layer in layers)
        assert not any(p.already for p in report.patched)
        reset_dispatch_report()
        with H.reference_core(family), torch.no_grad():
            H.loss_of(m, ids, family)
        assert op_counts("gated_delta_rule")["forward_calls"] == 2
    assert not any(is_patched(layer) for layer in layers)
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert site_value(family) is original

    # a layer patched before the block stays patched after it; the other is restored
    patch_model(m)
    first = H.delta_rule_layer_names(m, family)[0]
    unpatch_model(m, only={first})
    try:
        assert [is_patched(layer) for layer in layers] == [False, True]
        with patched(m) as report:
            assert [p.already for p in report.patched] == [False, True]
            assert all(is_patched(layer) for layer in layers)
        assert [is_patched(layer) for layer in layers] == [False, True]
        assert isinstance(site_value(family), CoreDispatcher)
        reset_dispatch_report()
        with H.reference_core(family), torch.no_grad():
            H.loss_of(m, ids, family)
        assert op_counts("gated_delta_rule")["forward_calls"] == 1
    finally:
        unpatch_model(m)
    assert site_value(family) is original

    # an exception inside the block still restores
    with pytest.raises(RuntimeError, match="boom"):
        with patched(m):
            raise RuntimeError("boom")
    assert not any(is_patched(layer) for layer in layers)
    assert site_value(family) is original


# ---------------------------------------------------------------------------
# 4. PEFT LoRA
# ---------------------------------------------------------------------------

def _lora(model, family):
    from peft import LoraConfig, get_peft_model

    fam = H.FAMILIES[family]
    layers = "|".join(re.escape(n) for n in H.delta_rule_layer_names(model, family))
    targets = rf"({layers})\.({'|'.join(fam.lora_targets)})"   # the delta-rule layers' projections only
    torch.manual_seed(123)   # same random LoRA weights for every model
    # init_lora_weights=False: random A and B, so both get non-zero gradients
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, config)


@pytest.mark.parametrize("family", ONE_PER_OP)
def test_peft_lora(family):
    fam = H.FAMILIES[family]
    ids = H.input_ids(2, T)
    base = H.build(family)

    ref = _lora(H.twin(base), family)
    with H.reference_core(family):
        _, g_ref = train_step(ref, family, ids)
    lora_names = {n for n, p in ref.named_parameters() if "lora_" in n}
    assert len(lora_names) == 2 * len(fam.lora_targets) * 2, sorted(lora_names)   # A and B, per target, per layer
    assert set(g_ref) == lora_names

    before = H.twin(base)
    patch_model(before)
    before = _lora(before, family)
    after = _lora(H.twin(base), family)
    report_after = patch_model(after)
    models = {"patch before get_peft_model": before, "patch after get_peft_model": after}
    try:
        assert [p.name for p in report_after.patched] == H.delta_rule_layer_names(after, family)
        assert all(p.name.startswith("base_model.model.") for p in report_after.patched)
        assert all(p.already for p in patch_model(before).patched)
        for label, model in models.items():
            assert {n for n, p in model.named_parameters() if p.requires_grad} == lora_names, label
            assert all(is_patched(layer) for layer in layers_of(model, family)), label
            reset_dispatch_report()
            with H.reference_core(family):
                _, g = train_step(model, family, ids)
            e = op_counts(fam.op)
            assert (e["forward_calls"], e["optimized_backward_calls"]) == (2, 2), (label, e)
            assert set(g) == lora_names, f"{label}: only LoRA parameters may get gradients"
            errs = {n: rel_err(g[n], g_ref[n]) for n in lora_names}
            assert max(errs.values()) <= 1e-5, f"{label}: LoRA grad rel errors {errs}"
            assert all(g_ref[n].norm() > 0 for n in lora_names)
    finally:
        for model in models.values():
            unpatch_model(model)


# ---------------------------------------------------------------------------
# 5. save_pretrained / from_pretrained
# ---------------------------------------------------------------------------

def _files(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


@pytest.mark.parametrize("family", ONE_PER_OP)
def test_save_pretrained_is_unchanged(family, tmp_path):
    ids = H.input_ids(2, T)
    model = H.build(family)
    plain = H.twin(model)
    patch_model(model)
    try:
        model.save_pretrained(tmp_path / "patched", safe_serialization=True)
        plain.save_pretrained(tmp_path / "plain", safe_serialization=True)
        assert all(is_patched(layer) for layer in layers_of(model, family)), "saving must not unpatch"
    finally:
        unpatch_model(model)
    patched_files, plain_files = _files(tmp_path / "patched"), _files(tmp_path / "plain")
    assert any(name.endswith(".safetensors") for name in patched_files)
    assert sorted(patched_files) == sorted(plain_files)
    for name in plain_files:
        assert patched_files[name] == plain_files[name], f"{name} differs"

    loaded = type(plain).from_pretrained(tmp_path / "patched", experts_implementation="eager").train()
    assert not any(is_patched(m) for m in loaded.modules())
    assert len(layers_of(loaded, family)) == 2
    with H.reference_core(family), torch.no_grad():
        expected = H.loss_of(plain, ids, family)
        got = H.loss_of(loaded, ids, family)
    assert rel_err(got, expected) <= 1e-6, (got.item(), expected.item())


# ---------------------------------------------------------------------------
# 6. Calls rewy refuses: fallback="error" / "original"
# ---------------------------------------------------------------------------
# transformers' plain-torch cores take a `chunk_size` argument (default 64),
# and the layers forward their **kwargs to the core, so `chunk_size=32` given
# to a layer (or to the model, which hands its kwargs down) reaches the core.
# rewy serves only chunk_size=64 and refuses with UnsupportedConfigError; the
# torch reference honours 32. No other refusal is reachable from these models'
# forward (the adapter passes only chunk_size, initial_state,
# output_final_state, use_qk_l2norm_in_kernel and cu_seqlens on; a bad
# cu_seqlens is an InputValidationError, wrong for the original core too).

def test_refused_call_error_names_layer():
    family = "qwen3_5"
    model = H.build(family)
    layer = layers_of(model, family)[0]
    name = H.delta_rule_layer_names(model, family)[0]
    hidden = torch.randn(2, T, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    patch_model(model)   # fallback="error"
    try:
        reset_dispatch_report()
        with H.reference_core(family), pytest.raises(UnsupportedConfigError) as info:
            layer(hidden, chunk_size=32)
        msg = str(info.value)
        assert name in msg and "Qwen3_5GatedDeltaNet" in msg, msg
        assert "chunk_size" in msg and "fallback='original'" in msg, msg
        assert op_counts("gated_delta_rule")["fallback_calls"] == 0
    finally:
        unpatch_model(model)


def test_refused_call_falls_back_to_original_layer_level():
    family = "qwen3_5"
    model = H.build(family)
    twin = H.twin(model)
    layer, twin_layer = layers_of(model, family)[0], layers_of(twin, family)[0]
    hidden = torch.randn(2, T, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with H.reference_core(family), torch.no_grad():
        expected = twin_layer(hidden, chunk_size=32)        # the torch core, honouring chunk_size=32
        default = twin_layer(hidden)
    assert not torch.equal(expected, default), "chunk_size=32 should change the float rounding of the torch core"
    # the original the dispatcher saves is the torch reference (reference_core active while patching)
    with H.reference_core(family):
        patch_model(model, fallback="original")
        try:
            reset_dispatch_report()
            with torch.no_grad():
                got = layer(hidden, chunk_size=32)
            e = op_counts("gated_delta_rule")
            assert (e["fallback_calls"], e["forward_calls"]) == (1, 0), e
            (reason, count), = e["fallback_reasons"].items()
            assert count == 1 and "chunk_size" in reason and "32" in reason, reason
            assert torch.equal(got, expected), "the fallback must be the original core itself"
            # a call rewy serves is still routed to rewy
            with torch.no_grad():
                layer(hidden)
            assert op_counts("gated_delta_rule")["forward_calls"] == 1
        finally:
            unpatch_model(model)


@pytest.mark.parametrize("family", ONE_PER_OP)
def test_refused_call_from_model_forward(family, monkeypatch):
    fam = H.FAMILIES[family]
    ids = H.input_ids(2, T)
    model = H.build(family)
    plain = H.twin(model)
    with H.reference_core(family), torch.no_grad():
        expected = plain(input_ids=ids, chunk_size=32)
    patch_model(model)
    try:
        with H.reference_core(family), torch.no_grad(), pytest.raises(UnsupportedConfigError, match="fallback='original'"):
            model(input_ids=ids, chunk_size=32)
    finally:
        unpatch_model(model)

    patch_model(model, fallback="original")
    try:
        # the original core saved by the dispatcher is the hub wrapper (FLA, Triton): make it the torch one
        dispatcher = site_value(family)
        assert isinstance(dispatcher, CoreDispatcher)
        monkeypatch.setattr(dispatcher, "original", torch_reference(fam.modeling, fam.site_attr))
        reset_dispatch_report()
        with torch.no_grad():
            got = model(input_ids=ids, chunk_size=32)
        e = op_counts(fam.op)
        assert (e["fallback_calls"], e["forward_calls"]) == (2, 0), e
        assert list(e["fallback_reasons"].values()) == [2]
        first = got.logits if hasattr(got, "logits") else got.last_hidden_state
        second = expected.logits if hasattr(expected, "logits") else expected.last_hidden_state
        assert torch.equal(first, second)
    finally:
        monkeypatch.undo()
        unpatch_model(model)


# ---------------------------------------------------------------------------
# 7. No delta-rule layer; the report's text and dict
# ---------------------------------------------------------------------------

def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_model_without_delta_rule_layer():
    model = _tiny_llama()
    with pytest.raises(UnsupportedConfigError) as info:
        patch_model(model)
    msg = str(info.value)
    assert "LlamaForCausalLM" in msg
    for fam in H.FAMILIES.values():
        assert fam.layer_class in msg, f"{fam.layer_class} missing from: {msg}"
    assert not any("forward" in m.__dict__ or is_patched(m) for m in model.modules())

    report = patch_model(model, strict=False)
    assert len(report) == 0 and report.patched == [] and report.skipped == []
    assert json.loads(json.dumps(report.to_dict()))["patched"] == []
    assert "0 delta-rule layer(s) patched" in str(report)


def test_report_text_and_dict():
    family = "qwen3_5"
    model = H.build(family)

    class MyGatedDeltaNet(nn.Module):       # looks like a delta-rule mixer, but no adapter serves it
        def forward(self, x):
            return x

    model.extra_mixer = MyGatedDeltaNet()
    report = patch_model(model, strict=False)
    try:
        names = H.delta_rule_layer_names(model, family)
        text = str(report)
        for name in names:
            assert name in text
        assert "Qwen3_5GatedDeltaNet" in text and "gated_delta_rule" in text
        assert [s.name for s in report.skipped] == ["extra_mixer"]
        assert "extra_mixer" in text and "MyGatedDeltaNet" in text and "not patched" in text
        d = json.loads(json.dumps(report.to_dict()))
        assert [p["name"] for p in d["patched"]] == names
        assert d["skipped"][0]["name"] == "extra_mixer" and d["skipped"][0]["reason"]
        assert (d["backend"], d["policy"], d["fallback"]) == ("auto", "recompute", "error")
    finally:
        unpatch_model(model)
