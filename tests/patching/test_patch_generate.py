"""Generation with a cache on CPU after ``patch_model``.

transformers picks FLA's recurrent kernel for a one-token decode step whenever
FLA is importable, and that kernel needs CUDA. A patched layer's decode step
on CPU runs the plain-torch recurrence behind transformers' wrapper instead:
generating with the cache must give the tokens that greedy decoding without a
cache gives (every step a full forward through rewy's chunked core), and the
decode site must be restored with the chunked one on unpatch. Under the test
interpreter FLA's kernel could run on CPU, so here it fails as it does on a
CPU machine without the interpreter.
"""

from __future__ import annotations

import pytest
import torch

import rewy_hf
from hf_tiny_models import build, family_of, input_ids

DECODE_ATTR = {"qwen3_5": "torch_recurrent_gated_delta_rule", "kimi_linear": "recurrent_kimi_delta_attention"}
FLA_DECODE = {"qwen3_5": ("fla.ops.gated_delta_rule.fused_recurrent", "fused_recurrent_gated_delta_rule_fwd"),
              "kimi_linear": ("fla.ops.kda.fused_recurrent", "fused_recurrent_kda_fwd")}


def _no_driver(*_, **__):
    raise RuntimeError("0 active drivers ([]). There should only be one.")


def _greedy_without_cache(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        logits = model(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_patched_model_generates_with_a_cache_on_cpu(family, monkeypatch):
    import gc
    import importlib

    gc.collect()        # patched models other tests dropped release the sites now, not during this test
    module, name = FLA_DECODE[family]
    monkeypatch.setattr(importlib.import_module(module), name, _no_driver)
    model = build(family, train=False)
    prompt = input_ids(batch=2, seq_len=70)       # a prefill longer than one chunk
    rewy_hf.patch_model(model)
    modeling = family_of(family).modeling
    with torch.no_grad():
        expected = _greedy_without_cache(model, prompt, steps=4)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                             use_cache=True, pad_token_id=0)
    assert torch.equal(out, expected), (out[:, -4:], expected[:, -4:])
    assert isinstance(getattr(modeling, DECODE_ATTR[family]), rewy_hf.patching.dispatch.CoreDispatcher)
    rewy_hf.unpatch_model(model)
    assert not isinstance(getattr(modeling, DECODE_ATTR[family]), rewy_hf.patching.dispatch.CoreDispatcher)
