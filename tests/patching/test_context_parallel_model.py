"""rewy_hf.context_parallel's refusals, that FLA's short convolution receives the context inside
the block and not after it, and that transformers' convolution call becomes rewy's context-parallel
one there (the whole model split across ranks is in tests/ops/test_context_parallel.py)."""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace

import pytest
import torch

import fla_tiny_models as tiny
import hf_tiny_models as H
import rewy_hf
from rewy_hf import UnsupportedConfigError


def _context(T: int):
    # No process group: the core runs as a plain packed call, as in FLA.
    return SimpleNamespace(group=None, cu_seqlens=torch.tensor([0, T]), cu_seqlens_cpu=None, is_first_rank=True,
                           is_last_rank=True, pre_num_ranks=0, post_num_ranks=0, layout="contiguous")


def test_refuses_an_unpatched_model():
    with pytest.raises(UnsupportedConfigError, match="call rewy_hf.patch_model"):
        with rewy_hf.context_parallel(tiny.build("gated_deltanet"), _context(8)):
            pass


@pytest.mark.parametrize("family,layer", [("qwen3_5", "Qwen3_5Attention"), ("kimi_linear", "KimiLinearAttention")])
def test_transformers_hybrids_need_the_rows_bounds(family, layer):
    """Their attention layers attend over the whole row, so they need its sequence bounds (the split
    runs in tests/ops/test_context_parallel.py)."""
    model = H.build(family)
    rewy_hf.patch_model(model, backend="torch")
    with pytest.raises(UnsupportedConfigError, match=re.escape(f"has attention layers ({layer}); pass cu_seqlens=")):
        with rewy_hf.context_parallel(model, _context(8)):
            pass


def test_indexed_attention_is_refused():
    """Sparse (indexed) attention is not dense causal attention: an all-gather of keys and values
    followed by causal SDPA would compute something else."""
    model = H.build("qwen4_exp")
    rewy_hf.patch_model(model, backend="torch")
    with pytest.raises(UnsupportedConfigError, match=r"model.layers.1.self_attn \(\w+\) is neither a patched delta-rule "
                                                     r"layer nor a transformers full_attention layer"):
        with rewy_hf.context_parallel(model, _context(8), cu_seqlens=torch.tensor([0, 8])):
            pass


def test_attention_implementation_is_the_rows_inside_only():
    from rewy_hf.patching import context_parallel_attention as cpa

    model = H.build("qwen3_5")
    rewy_hf.patch_model(model, backend="torch")
    before = model.config._attn_implementation
    group = SimpleNamespace(group_name="stand-in")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torch.distributed.get_world_size", lambda g=None: 1)
        mp.setattr("torch.distributed.get_rank", lambda g=None: 0)
        with rewy_hf.context_parallel(model, SimpleNamespace(**{**vars(_context(8)), "group": group}),
                                      cu_seqlens=torch.tensor([0, 3, 8])):
            assert model.config._attn_implementation == cpa.NAME
            assert model.model.layers[1].self_attn.config._attn_implementation == cpa.NAME
    assert model.config._attn_implementation == before
    with pytest.raises(UnsupportedConfigError, match="runs only inside rewy_hf.context_parallel"):
        cpa.row_attention(None, *[torch.zeros(1, 1, 8, 4)] * 3, None)


def test_refuses_other_token_mixers():
    """A token mixer rewy does not serve (an attention layer of a hybrid config; FLA's needs flash-attn,
    so a stand-in takes its place here) has no context parallelism."""
    model = tiny.build("gated_deltanet")
    rewy_hf.patch_model(model, backend="torch")
    model.model.layers[1].attn = torch.nn.Identity()
    with pytest.raises(UnsupportedConfigError, match=r"model.layers.1.attn \(Identity\) is neither a patched"):
        with rewy_hf.context_parallel(model, _context(8)):
            pass


def test_short_convolution_gets_the_context_inside_only(monkeypatch):
    seen = []

    def spy(*args, cp_context=None, **kwargs):
        seen.append(cp_context)
        return tiny.torch_causal_conv1d(*args, **kwargs)

    for name in ("fla.modules.causal_conv1d.ops", "fla.layers.gated_deltanet"):
        monkeypatch.setattr(importlib.import_module(name), "causal_conv1d", spy)
    model = tiny.build("gated_deltanet")
    rewy_hf.patch_model(model, backend="torch")
    ids = torch.randint(0, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    ctx = _context(8)
    with rewy_hf.context_parallel(model, ctx):
        inside = model(input_ids=ids, cu_seqlens=ctx.cu_seqlens).logits
    assert seen and all(c is ctx for c in seen)
    seen.clear()
    outside = model(input_ids=ids, cu_seqlens=ctx.cu_seqlens).logits
    assert seen and all(c is None for c in seen)
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)


def test_transformers_convolution_is_the_context_parallel_one_inside_only(monkeypatch):
    """Without a process group the context-parallel convolution exchanges nothing; with the context's
    packed bounds it restarts at each sequence, as each sequence run alone does."""
    from rewy_hf.kernels import context_parallel_conv
    from rewy_hf.kernels.context_parallel_call import CPCall

    calls = []
    real = context_parallel_conv.cp_causal_short_conv
    monkeypatch.setattr(context_parallel_conv, "cp_causal_short_conv",
                        lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    model = H.delta_rule_only("qwen3_5")
    rewy_hf.patch_model(model, backend="torch")
    ids = H.input_ids(1, 40)
    ctx = _context(40)
    ctx.cu_seqlens, ctx.pre_num_conv_tokens = torch.tensor([0, 17, 40]), 0
    with rewy_hf.context_parallel(model, ctx):
        packed = model(input_ids=ids).logits
    # one per layer, each with the context as a CPCall of its bounds
    assert len(calls) == 2 and all(isinstance(c, CPCall) and c.cu_seqlens is ctx.cu_seqlens for c in calls)
    calls.clear()
    alone = torch.cat([model(input_ids=ids[:, :17]).logits, model(input_ids=ids[:, 17:]).logits], dim=1)
    assert not calls
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
