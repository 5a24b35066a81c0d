"""Padding-free packed rows through patched models: every document as if it ran alone.

A row packed by ``DataCollatorWithFlattening`` (``position_ids`` restarting at
each document, optionally with the flash-attention bounds ``cu_seq_lens_q``
...) must give each document's outputs and gradients of that document run on
its own, in float64 (to 1e-10 where the model computes in float64 throughout,
to float32 rounding where the model itself rounds through float32), for
transformers' GDN and KDA hybrids and FLA's models; the documents' lengths put one bound at a chunk edge (64) and others
inside chunks, and one document is a single token. Under torch.compile, a new
packing each step compiles no new graph once the first packings are seen, and
nothing breaks the graph inside a delta-rule layer.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DataCollatorWithFlattening

import rewy_hf
from rewy_hf import patch_model, unpatch_model
from rewy_hf.errors import UnsupportedConfigError
from rewy_hf.rel_error import rel_err

import fla_tiny_models as fla_tiny
import hf_tiny_models as hf

LENGTHS = (64, 37, 1, 26)          # bounds at 64 (a chunk edge), 101 and 102 (inside the second chunk)
TOL = 1e-10


def _docs(vocab: int, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


def _packed(docs, flash_kwargs: bool) -> dict:
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    return batch


def _readout(vocab: int, T: int) -> torch.Tensor:
    """Fixed weights per (token, logit): the loss is a sum over tokens, so the packed row's gradient
    is the sum of its documents' gradients."""
    return torch.randn(T, vocab, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


def _logits(out) -> torch.Tensor:
    return out.logits[0]


def _packed_and_alone(model, docs, flash_kwargs: bool):
    """(logits, gradients) of the packed row, and the same assembled from the documents run alone."""
    vocab = model.config.vocab_size if hasattr(model, "config") else fla_tiny.VOCAB
    T = sum(len(d) for d in docs)
    weights = _readout(vocab, T)
    model.zero_grad(set_to_none=True)
    packed = _logits(model(**_packed(docs, flash_kwargs)))
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    alone, start = [], 0
    for d in docs:
        logits = _logits(model(input_ids=d[None], use_cache=False))
        (logits * weights[start:start + len(d)]).sum().backward()
        alone.append(logits.detach())
        start += len(d)
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert packed_grads.keys() == alone_grads.keys()
    return packed.detach(), packed_grads, torch.cat(alone), alone_grads


def _worst(grads: dict, ref: dict) -> float:
    return max(rel_err(grads[n], ref[n]) for n in ref)


# transformers' RMSNorms and GDN gate compute in float32 whatever the model's dtype, so the gradients
# of their weights (and of A_log) are token sums rounded in float32: packed or alone, those sums run
# in another order. Every other gradient, the delta-rule layers' own included, is held to TOL.
_FLOAT32_SUMS = ("norm", "A_log")


# Models that round every token through float32 somewhere, whatever their dtype: Kimi-Linear's layer
# (its gate, gated output norm and MoE router) and FLA's models (their norms are Triton kernels, which
# the interpreter runs in float32). Between the packed and the separate runs a value there may round
# one float32 ulp apart, which reaches every gradient at about 1e-8; a leak across documents is 1e-3
# or more. Their cores are held to 1e-10 on packed input by the op-level float64 tests.
FLOAT32_TOL = 1e-6


def _assert_grads_match(grads: dict, ref: dict, tol: float = TOL) -> None:
    exact = {n for n in ref if not any(k in n for k in _FLOAT32_SUMS)}
    assert any("attn" in n for n in exact)
    assert max(rel_err(grads[n], ref[n]) for n in exact) < tol
    assert _worst(grads, ref) < FLOAT32_TOL


HF_FAMILIES = ("qwen3_5", "qwen3_next", "kimi_linear", "olmo_hybrid")


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "flash_kwargs"])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_transformers_packed_row_equals_its_documents(family, flash_kwargs):
    model = hf.build(family, dtype=torch.float64, route_all_experts=True)
    patch_model(model, backend="torch")
    docs = _docs(hf.VOCAB)
    before = rewy_hf.dispatch_report()
    logits, grads, ref_logits, ref_grads = _packed_and_alone(model, docs, flash_kwargs)
    tol = FLOAT32_TOL if family == "kimi_linear" else TOL
    assert rel_err(logits, ref_logits) < tol
    _assert_grads_match(grads, ref_grads, tol)
    ran = rewy_hf.patching.dispatch.report_difference(before, rewy_hf.dispatch_report())
    assert rewy_hf.patching.dispatch.total_calls(ran, "optimized_backward_calls") > 0


@pytest.mark.parametrize("family", ("qwen3_5", "kimi_linear"))
def test_unpatched_transformers_leaks_across_documents(family):
    """The property the packed tests check is not vacuous: transformers' own layers run each
    document's recurrence and convolution on from the one before."""
    model = hf.build(family, dtype=torch.float64, route_all_experts=True)
    with hf.reference_core(family):
        logits, grads, ref_logits, ref_grads = _packed_and_alone(model, _docs(hf.VOCAB), flash_kwargs=True)
    assert rel_err(logits, ref_logits) > 1e-3
    assert _worst(grads, ref_grads) > 1e-3


@pytest.mark.parametrize("kind", ("delta_net", "gated_deltanet", "kda"))
def test_fla_packed_row_equals_its_documents(kind):
    model = fla_tiny.build(kind, dtype=torch.float64)
    patch_model(model, backend="torch")
    with fla_tiny.torch_short_conv():
        logits, grads, ref_logits, ref_grads = _packed_and_alone(model, _docs(fla_tiny.VOCAB), flash_kwargs=False)
    assert rel_err(logits, ref_logits) < FLOAT32_TOL
    _assert_grads_match(grads, ref_grads, FLOAT32_TOL)


def test_a_forward_replaced_after_patching_still_gets_the_bounds_and_unpatching_keeps_it():
    """Liger-Kernel's ``apply_liger_kernel_to_*(model=...)`` and accelerate replace the instance's
    forward after rewy may have patched it: the bounds still reach that forward, and unpatching
    leaves it in place."""
    model = hf.build("qwen3_5")
    patch_model(model, backend="torch")
    seen = {}
    inner = model.forward

    def replaced(*args, **kwargs):
        seen.update(kwargs)
        return inner(*args, **kwargs)

    model.forward = replaced
    batch = _packed(_docs(model.config.vocab_size), flash_kwargs=False)
    model(**batch)
    bounds = [0] + list(torch.tensor(LENGTHS).cumsum(0).tolist())
    assert seen["cu_seq_lens_q"].tolist() == bounds and seen["use_cache"] is False
    unpatch_model(model)
    assert model.forward is replaced
    seen.clear()
    model(**batch)
    assert "cu_seq_lens_q" not in seen


def test_a_row_of_one_document_takes_the_packed_path_unless_a_cache_is_asked_for():
    """A packed run whose row happens to hold one document must not switch kernels for that step;
    a prefill (use_cache=True) keeps the row as the caller gave it."""
    model = hf.build("qwen3_5")
    patch_model(model, backend="torch")
    seen = {}
    inner = model.forward

    def spy(*args, **kwargs):
        seen.clear()
        seen.update(kwargs)
        return inner(*args, **kwargs)

    model.forward = spy
    ids = hf.input_ids(batch=1, seq_len=20)
    packed = model(input_ids=ids, position_ids=torch.arange(20)[None]).logits
    assert seen["cu_seq_lens_q"].tolist() == [0, 20] and seen["use_cache"] is False
    prefill = model(input_ids=ids, position_ids=torch.arange(20)[None], use_cache=True).logits
    assert "cu_seq_lens_q" not in seen
    assert rel_err(packed, prefill) < 1e-6


def test_rows_of_a_batch_that_restart_are_refused():
    model = hf.build("qwen3_5")
    patch_model(model, backend="torch")
    ids = hf.input_ids(batch=2, seq_len=20)
    positions = torch.cat([torch.arange(12), torch.arange(8)]).expand(2, -1)
    with pytest.raises(UnsupportedConfigError, match="one packed row"):
        model(input_ids=ids, position_ids=positions)


def test_a_packed_row_with_a_cache_is_refused():
    model = hf.build("qwen3_5")
    patch_model(model, backend="torch")
    with pytest.raises(UnsupportedConfigError, match="use_cache=False"):
        model(**_packed(_docs(hf.VOCAB), flash_kwargs=False), use_cache=True)


def _packings(steps: int, T: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(steps):
        n = rng.randint(2, 5)
        cuts = sorted(rng.sample(range(1, T), n - 1))
        yield [b - a for a, b in zip([0] + cuts, cuts + [T])]


def _row(lens, vocab: int, flash_kwargs: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, vocab, (n,), generator=gen) for n in lens]
    return _packed(docs, flash_kwargs)


@pytest.mark.parametrize("family,flash_kwargs,most_frames", [
    ("qwen3_5", False, 1), ("qwen3_5", True, 2), ("kimi_linear", False, None)])
def test_compiled_packings_do_not_recompile(family, flash_kwargs, most_frames):
    """Eight packings of 1-5 documents in 160 tokens: the frames compiled by the third step are all
    there are, a row of one document among the later ones; with bounds from position_ids the one
    graph break is at the model's entry (the bounds are read there), never in a delta-rule layer;
    compiled gradients are the eager ones."""
    import torch._dynamo.utils as dynamo_utils
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    if family == "qwen3_5":
        model = hf.one_layer_qwen3_5()
    else:
        model = hf.delta_rule_only(family, layers=1, route_all_experts=True)
    eager = hf.twin(model)
    patch_model(model, backend="torch")
    patch_model(eager, backend="torch")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    frames = []
    # a row of one document, and one whose first document is a single token, among them
    packings = list(_packings(6, 160))
    packings[3:3] = [[160], [1, 159]]
    for step, lens in enumerate(packings):
        batch = _row(lens, hf.VOCAB, flash_kwargs, seed=step)
        for m in (compiled, eager):
            m.zero_grad(set_to_none=True) if hasattr(m, "zero_grad") else None
        compiled(**batch).logits.square().mean().backward()
        eager(**batch).logits.square().mean().backward()
        frames.append(counter.frame_count)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        ref = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
        assert grads.keys() == ref.keys() and _worst(grads, ref) < 1e-5
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert frames[2] == frames[-1], frames
    if most_frames is not None:
        assert frames[-1] <= most_frames, frames
    breaks = " ".join(dynamo_utils.counters["graph_break"])
    assert "rewy" not in breaks.replace("bounds_from_positions", ""), breaks
    if family == "qwen3_5":
        assert not breaks or "bounds_from_positions" in breaks, breaks
    torch._dynamo.reset()
