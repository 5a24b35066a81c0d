"""patch_model's arguments: a second call with other options, and something that is not a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import rewy_hf
from rewy_hf import UnsupportedConfigError

import hf_tiny_models as hf


def test_second_patch_with_other_options_is_refused_and_keeps_the_first():
    model = hf.build("qwen3_5")
    rewy_hf.patch_model(model, backend="torch")
    with pytest.raises(UnsupportedConfigError, match="already patched with policy='recompute' \\(asked: 'full'\\)"):
        rewy_hf.patch_model(model, backend="torch", policy="full", fallback="original")
    again = rewy_hf.patch_model(model, backend="torch")          # the same options: idempotent
    assert again.patched and all(p.already and p.policy == "recompute" for p in again.patched)
    assert rewy_hf.unpatch_model(model) == len(hf.delta_rule_layer_names(model, "qwen3_5"))
    report = rewy_hf.patch_model(model, backend="torch", policy="full")     # after unpatching: new options
    assert all(p.policy == "full" and not p.already for p in report.patched)


@pytest.mark.parametrize("thing", ["not a model", None, nn.Linear])
def test_patching_something_that_is_not_a_module_is_named(thing):
    with pytest.raises(UnsupportedConfigError, match="patch_model expects a torch.nn.Module .*; load the model first"):
        rewy_hf.patch_model(thing)


def test_auto_is_decided_per_call_so_a_model_patched_on_cpu_gets_triton_once_on_a_gpu(monkeypatch):
    # Patching usually happens before `.to("cuda")` / `accelerator.prepare`: freezing `auto` to the
    # torch backend at patch time would then run the slow torch core on the GPU, silently under compile.
    import rewy_hf.ops as ops
    from rewy_hf.validation import resolve_backend

    asked = []
    monkeypatch.setattr(ops, "resolve_backend", lambda backend, *a: asked.append(backend) or resolve_backend(backend, *a))
    model = hf.build("qwen3_5")
    report = rewy_hf.patch_model(model)
    assert report.backend == "auto" and all(p.backend == "auto" for p in report.patched)
    hf.loss_of(model, hf.input_ids(1, 16), "qwen3_5").backward()
    assert asked and set(asked) == {"auto"}
    assert resolve_backend("auto", torch.device("cuda"), None) == "triton"
