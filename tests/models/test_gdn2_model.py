"""The GDN2 causal LM (rewy_hf.models.gdn2) on CPU.

FLA's short convolution and gated norm run under Triton's interpreter (see
conftest.py), but FLA's ``chunk_gdn2`` has no CPU path, so every model here is
run only after ``rewy_hf.patch_model`` has routed the GDN2 layers' chunk core
to rewy's torch backend. T = 65 > 64 keeps FLA's layer on its chunk path in
eval mode too (it switches to fused_recurrent for q_len <= 64).

FLA's full-attention layer refuses to be built without ``flash_attn``; the
hybrid tests put an SDPA stand-in in its place (structure only, no forward).
The interpreter is slow (the short convolution dominates), so the file runs
one training step and two eval forwards (without short convolution) in all.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.models.gdn2 import GDN2_PRESETS, GDN2Config, GDN2ForCausalLM, GDN2Model, gdn2_config

T = 65


def _ids(batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, GDN2_PRESETS["tiny"]["vocab_size"], (batch, T), generator=g)


def _tiny(seed: int = 0, **overrides) -> GDN2ForCausalLM:
    torch.manual_seed(seed)
    return GDN2ForCausalLM(gdn2_config("tiny", **overrides))


def _sdpa_flash_attn(q, k, v, causal=True, window_size=(-1, -1), **_):
    """flash_attn_func's layout ([B, T, H, D]) on torch SDPA, full causal attention only."""
    assert causal and window_size == (-1, -1)
    rep = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(rep, dim=2) for x in (k, v))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


@pytest.fixture
def flash_attn_stub(monkeypatch):
    import fla.layers.attn
    monkeypatch.setattr(fla.layers.attn, "flash_attn_func", _sdpa_flash_attn)


def _meta_param_count(config: GDN2Config) -> int:
    with torch.device("meta"):
        model = GDN2ForCausalLM(config)
    assert all(p.is_meta for p in model.parameters())
    return model.num_parameters()


def test_tiny_preset_builds():
    model = _tiny()
    cfg = model.config
    assert isinstance(cfg, GDN2Config) and cfg.model_type == "gdn2"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (64, 2, 4, 16, 256)
    assert isinstance(model.model, GDN2Model) and len(model.model.layers) == 2
    from fla.layers import GatedDeltaNet2
    for i, block in enumerate(model.model.layers):
        assert isinstance(block.attn, GatedDeltaNet2) and block.attn.layer_idx == i
    names = dict(model.named_parameters())
    assert "model.layers.0.attn.q_proj.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert "lm_head.weight" in names and "model.embeddings.weight" in names
    # The mixer's decay parameters come out of init in the layer's own ranges.
    a = model.model.layers[0].attn.A_log.exp()
    assert ((a >= 1) & (a <= 16)).all()
    assert 0 < model.num_parameters() < 1e6


def test_patch_reports_every_gdn2_mixer():
    model = _tiny()
    report = rewy_hf.patch_model(model)
    assert [(p.name, p.layer_class, p.op) for p in report.patched] == [
        (f"model.layers.{i}.attn", "GatedDeltaNet2", "gdn2") for i in range(2)]
    assert not report.skipped
    assert all(rewy_hf.is_patched(block.attn) for block in model.model.layers)
    assert rewy_hf.unpatch_model(model) == 2


def test_training_step_gives_finite_loss_and_all_grads():
    model = _tiny().train()
    rewy_hf.patch_model(model)
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, T, 256)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, bad
    assert any(p.grad.abs().sum() > 0 for p in model.model.layers[0].attn.parameters())
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    rewy_hf.unpatch_model(model)


def test_gradient_checkpointing_can_be_enabled():
    model = _tiny()
    assert model.supports_gradient_checkpointing
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(block.gradient_checkpointing for block in model.model.layers)


def _roundtrip(model: GDN2ForCausalLM, path) -> GDN2ForCausalLM:
    """save_pretrained (safetensors), then AutoModelForCausalLM.from_pretrained; checks the state dict."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(path, safe_serialization=True)
    assert (path / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(reloaded) is GDN2ForCausalLM
    ref, new = model.state_dict(), reloaded.state_dict()
    assert ref.keys() == new.keys()
    for name in ref:
        assert new[name].dtype == ref[name].dtype, name
        assert torch.equal(new[name], ref[name]), name
    return reloaded


def test_save_and_reload_with_auto_classes(tmp_path):
    from transformers import AutoConfig

    model = _tiny()
    reloaded = _roundtrip(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gdn2"
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is GDN2Config
    for key in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "expand_v", "use_short_conv",
                "allow_neg_eigval", "intermediate_size", "norm_eps", "fuse_norm", "attn", "vocab_size"):
        assert getattr(config, key) == getattr(model.config, key) == getattr(reloaded.config, key), key


def test_reloaded_model_gives_identical_loss(tmp_path):
    # Without the short convolution: its Triton kernels are the slowest part under the interpreter,
    # and the training test already runs them. The checkpoint path is the same.
    model = _tiny(use_short_conv=False).eval()
    reloaded = _roundtrip(model, tmp_path).eval()
    ids = _ids()
    losses = []
    for m in (model, reloaded):
        assert len(rewy_hf.patch_model(m).patched) == 2
        with torch.no_grad():
            losses.append(m(input_ids=ids, labels=ids).loss)
        rewy_hf.unpatch_model(m)
    assert torch.isfinite(losses[0])
    assert torch.equal(losses[0], losses[1])


def test_hybrid_layout_puts_attention_where_asked(flash_attn_stub):
    from fla.layers import GatedDeltaNet2
    from fla.layers.attn import Attention

    config = gdn2_config("tiny", num_hidden_layers=4, attn={"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2})
    assert config.attn["layers"] == [1, 3] and config.attn["window_size"] is None   # FLA filled the defaults
    model = GDN2ForCausalLM(config)
    kinds = [type(block.attn) for block in model.model.layers]
    assert kinds == [GatedDeltaNet2, Attention, GatedDeltaNet2, Attention]
    assert model.model.layers[1].attn.num_kv_heads == 2
    report = rewy_hf.patch_model(model)
    assert [p.name for p in report.patched] == ["model.layers.0.attn", "model.layers.2.attn"]
    assert not report.skipped
    assert not rewy_hf.is_patched(model.model.layers[1].attn)
    rewy_hf.unpatch_model(model)


def test_attn_config_is_validated():
    with pytest.raises(ValueError, match=r"out-of-range layer 2; expected a value in \[0, 2\)"):
        gdn2_config("tiny", attn={"layers": [2], "num_heads": 4})   # only layers 0 and 1 exist


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown GDN2 preset"):
        gdn2_config("7b")


def test_1b_preset_param_count_on_meta():
    config = gdn2_config("1b")
    assert (config.hidden_size, config.num_heads, config.head_dim) == (2048, 16, 128)
    assert 0.8e9 <= _meta_param_count(config) <= 1.3e9


def test_preset_param_counts_match_docs(flash_attn_stub):
    """The preset table in configuration_gdn2.py's docstring gives each preset's exact parameter count."""
    from rewy_hf.models.gdn2 import configuration_gdn2

    rows = [line.split() for line in configuration_gdn2.__doc__.splitlines() if line.split()[:1] in
            ([name] for name in GDN2_PRESETS)]
    documented = {row[0]: int(row[-1].replace(",", "")) for row in rows}
    assert set(documented) == set(GDN2_PRESETS)
    assert {name: _meta_param_count(gdn2_config(name)) for name in GDN2_PRESETS} == documented


def test_1b_hybrid_has_attention_every_fourth_layer(flash_attn_stub):
    from fla.layers.attn import Attention

    config = gdn2_config("1b-hybrid")
    assert config.attn["layers"] == [3, 7, 11, 15, 19]
    with torch.device("meta"):
        model = GDN2ForCausalLM(config)
    attn_layers = [i for i, block in enumerate(model.model.layers) if isinstance(block.attn, Attention)]
    assert attn_layers == [3, 7, 11, 15, 19]
