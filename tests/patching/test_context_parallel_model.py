"""rewy_hf.context_parallel's refusals, and that FLA's short convolution receives the context inside
the block and not after it (the whole model split across ranks is in tests/ops/test_context_parallel.py)."""

from __future__ import annotations

import importlib
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


def test_refuses_transformers_layers():
    model = H.build("qwen3_5")
    rewy_hf.patch_model(model, backend="torch")
    with pytest.raises(UnsupportedConfigError, match="is a transformers layer: its short convolution"):
        with rewy_hf.context_parallel(model, _context(8)):
            pass


def test_refuses_other_token_mixers():
    """A token mixer rewy does not serve (an attention layer of a hybrid config; FLA's needs flash-attn,
    so a stand-in takes its place here) has no context parallelism."""
    model = tiny.build("gated_deltanet")
    rewy_hf.patch_model(model, backend="torch")
    model.model.layers[1].attn = torch.nn.Identity()
    with pytest.raises(UnsupportedConfigError, match=r"model.layers.1.attn \(Identity\) is not a patched"):
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
