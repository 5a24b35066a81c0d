"""The packed fine-tuning benchmark's batches and its check against the documents (CPU, tiny model)."""

from __future__ import annotations

import torch

from rewy_hf.bench import packed_bench
from rewy_hf.models.presets import build_preset


def test_packings_fill_the_row_and_mark_each_document():
    batches, lengths = packed_bench.packings(4, 8192, 248320, seed=0, device="cpu")
    assert len({tuple(x) for x in lengths}) == 4, "a new packing every step"
    for batch, lens in zip(batches, lengths):
        assert sum(lens) == 8192 and min(lens[:-1]) >= 16 and len(lens) > 2
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        assert torch.equal((batch["position_ids"][0] == 0).nonzero().squeeze(1), starts)
        assert torch.equal((batch["labels"][0] == -100).nonzero().squeeze(1), starts)
        assert batch["input_ids"].shape == (1, 8192) and int(batch["input_ids"].max()) < 248320


def test_documents_check_separates_the_patched_model_from_the_leaking_one():
    model = build_preset("tiny-qwen3.5").train()
    out = packed_bench.documents_check(model, model.config.vocab_size, "cpu", T=2048)
    assert out["patched"]["logits_rel_err"] < 1e-5 and out["patched"]["grads_rel_err"] < 1e-5
    assert out["unpatched"]["logits_rel_err"] > 1e-3 and out["unpatched"]["grads_rel_err"] > 1e-3
