"""causal_only_masks: a transformers hybrid handed the mapping computes what it computes eagerly
without one, and under torch.compile its attention gets no materialized mask."""

from __future__ import annotations

from unittest import mock

import hf_tiny_models as hf
import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.models.causal_masks import causal_only_masks


def _loss_and_grads(run, model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = run(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_compiled_attention_gets_no_mask_and_the_step_is_unchanged(family):
    model = hf.build(family)
    rewy_hf.patch_model(model, backend="torch")
    ids = hf.input_ids()
    ref_loss, ref_grads = _loss_and_grads(model, model, ids)

    masks_seen = []
    sdpa = F.scaled_dot_product_attention

    def watching(*args, **kwargs):
        # Runs while dynamo traces: what the compiled graph's attention is handed.
        masks_seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    torch._dynamo.reset()
    with mock.patch.object(F, "scaled_dot_product_attention", watching):
        loss, grads = _loss_and_grads(torch.compile(model, backend="aot_eager"), model, ids,
                                      attention_mask=causal_only_masks(model))
    torch._dynamo.reset()
    assert masks_seen and set(masks_seen) == {(True, True)}
    assert _rel(loss, ref_loss) < 1e-6
    assert grads.keys() == ref_grads.keys()
    assert max(_rel(grads[n], ref_grads[n]) for n in grads) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_next", "olmo_hybrid", "qwen3_5_moe"])
def test_every_listed_hybrid_reads_the_mapping(family):
    """Eagerly the mapping gives the loss of no mapping: the forward takes it and finds a mask (None)
    for every layer type."""
    model = hf.build(family)
    rewy_hf.patch_model(model, backend="torch")
    ids = hf.input_ids()
    masks = causal_only_masks(model)
    assert set(masks) == set(model.config.layer_types) and all(m is None for m in masks.values())
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids, use_cache=False).loss
        mapped = model(input_ids=ids, labels=ids, use_cache=False, attention_mask=masks).loss
    assert _rel(mapped, plain) < 1e-6


def test_other_models_get_none_and_peft_is_looked_through():
    from peft import LoraConfig, get_peft_model

    from rewy_hf.models.presets import build_preset

    assert causal_only_masks(build_preset("tiny-fla-gdn2")) is None
    assert causal_only_masks(torch.nn.Linear(2, 2)) is None
    wrapped = get_peft_model(hf.build("qwen3_5"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert causal_only_masks(wrapped) == {"full_attention": None, "linear_attention": None}
