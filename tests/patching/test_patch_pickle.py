"""torch.save / torch.load of a patched model keeps it patched and routed."""

from __future__ import annotations

import io

import torch

import rewy_hf
from rewy_hf.models.presets import build_preset


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_saved_patched_model_reloads_patched():
    model = build_preset("tiny-qwen3.5")
    rewy_hf.patch_model(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
    expected = _loss(model, ids).item()

    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    layer = loaded.model.layers[0].linear_attn
    assert rewy_hf.is_patched(layer)
    from rewy_hf.patching.patch import _enter, _leave

    # the hooks that mark the layer active came along (they find the layer's state through the layer)
    assert list(layer._forward_pre_hooks.values()) == [_enter] and list(layer._forward_hooks.values()) == [_leave]

    rewy_hf.reset_dispatch_report()
    loss = _loss(loaded, ids)
    loss.backward()
    counts = rewy_hf.dispatch_report()["ops"]["gated_delta_rule"]
    assert counts["forward_calls"] == 1 and counts["optimized_backward_calls"] == 1
    assert loss.item() == expected
    assert rewy_hf.unpatch_model(loaded) == 1 and not rewy_hf.is_patched(layer)
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    # The original stays patched until unpatched (or collected): leave no patched instance behind.
    assert rewy_hf.unpatch_model(model) == 1
