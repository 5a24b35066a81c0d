"""rewy with Liger-Kernel's patch of Qwen3.5 / Qwen3-Next, applied before or after rewy's.

Liger's ``apply_liger_kernel_to_*(model=...)`` replaces the model's instance
``forward`` (fused linear cross-entropy) and swaps its RMSNorm and MLP
modules; it leaves the delta-rule layers alone. Either order, the patched
layers must still run rewy's core, a packed row must still keep its documents
apart (its summed loss equals the documents' run one by one), and unpatching
rewy must leave Liger's forward in place.

The first test applies only Liger's fused linear cross-entropy (its RMSNorm
and SwiGLU kernels fail under Triton's interpreter) and runs in float32 on
the GPU where there is one, else on the CPU; the GPU test applies all of
Liger's defaults in bf16.
"""

from __future__ import annotations

import pytest
import torch

import rewy_hf
from rewy_hf import patch_model, unpatch_model

import hf_tiny_models as hf
from test_packed_rows import LENGTHS, _docs, _packed

liger = pytest.importorskip("liger_kernel.transformers.monkey_patch")

ON_GPU = torch.cuda.is_available()


def _apply_liger(model, family: str, monkeypatch, full: bool) -> None:
    modeling = hf.family_of(family).modeling
    # Liger also rebinds module-level classes for models built later; keep those to this test.
    for name in [n for n in vars(modeling) if n.endswith(("RMSNorm", "MLP", "ForCausalLM"))]:
        monkeypatch.setattr(modeling, name, getattr(modeling, name))
    monkeypatch.setattr(getattr(modeling, hf.family_of(family).model_class), "forward",
                        getattr(modeling, hf.family_of(family).model_class).forward)
    options = {} if full else dict(rms_norm=False, swiglu=False)
    getattr(liger, f"apply_liger_kernel_to_{family}")(model=model, **options)


def _summed_loss(model, batch: dict) -> torch.Tensor:
    """The loss summed over the predicted tokens (Liger's and transformers' losses are means)."""
    labels = batch["labels"]
    counted = int((labels[:, 1:] != -100).sum())
    return model(**batch).loss * counted


def _check(model, device: str, tol: float) -> None:
    docs = _docs(model.config.vocab_size)
    packed = _packed(docs, flash_kwargs=False)
    packed["labels"] = packed["input_ids"].clone()
    packed["labels"][packed["position_ids"] == 0] = -100
    to = {k: v.to(device) for k, v in packed.items()}
    before = rewy_hf.dispatch_report()["ops"].get("gated_delta_rule", {}).get("optimized_backward_calls", 0)
    total = _summed_loss(model, to)
    total.backward()
    after = rewy_hf.dispatch_report()["ops"]["gated_delta_rule"]["optimized_backward_calls"]
    assert after - before == 2                       # both delta-rule layers ran rewy's backward
    with torch.no_grad():
        alone = sum(float(_summed_loss(model, {"input_ids": d[None].to(device), "labels": d[None].to(device)}))
                    for d in docs if len(d) > 1)
    assert abs(float(total) - alone) <= tol * abs(alone), (float(total), alone)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("liger_first", [True, False], ids=["liger-then-rewy", "rewy-then-liger"])
def test_liger_before_or_after_rewy_keeps_rewy_and_the_documents(family, liger_first, monkeypatch):
    device = "cuda" if ON_GPU else "cpu"
    model = hf.build(family).to(device)
    if liger_first:
        _apply_liger(model, family, monkeypatch, full=False)
    patch_model(model)
    if not liger_first:
        _apply_liger(model, family, monkeypatch, full=False)
    liger_forward = model.__dict__["forward"]
    _check(model, device, 1e-5 if device == "cpu" else 1e-4)
    unpatch_model(model)
    assert model.__dict__["forward"] is liger_forward


@pytest.mark.gpu
@pytest.mark.parametrize("liger_first", [True, False], ids=["liger-then-rewy", "rewy-then-liger"])
def test_full_liger_with_rewy_on_the_gpu(liger_first, monkeypatch):
    model = hf.build("qwen3_5").to("cuda", torch.bfloat16)
    if liger_first:
        _apply_liger(model, "qwen3_5", monkeypatch, full=True)
    patch_model(model, backend="triton")
    if not liger_first:
        _apply_liger(model, "qwen3_5", monkeypatch, full=True)
    assert type(model.model.norm).__module__.startswith("liger_kernel")
    _check(model, "cuda", 2e-2)
    unpatch_model(model)
