"""rewy_hf.context_parallel's refusals, that FLA's short convolution receives the context inside
the block and not after it, and that transformers' convolution call becomes rewy's context-parallel
one there (the whole model split across ranks is in tests/ops/test_context_parallel.py). The
contexts here are FLA's, over a gloo group of this one process: the exchanges run, with nothing to
exchange."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fla_tiny_models as tiny
import hf_tiny_models as H
import rewy_hf
from rewy_hf import InputValidationError, UnsupportedConfigError
from rewy_hf.models.causal_masks import causal_only_masks
from rewy_hf.patching.context_parallel_attention import RowAttention
from support.cp_ranks import free_port, refusal_rank_main


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """A gloo group of this process alone, for the module's tests."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _context(bounds):
    from fla.ops.cp import build_cp_context

    return build_cp_context(torch.tensor(bounds), group=dist.group.WORLD)


def _hybrid():
    model = H.build("qwen3_5")
    model.config.use_cache = False
    rewy_hf.patch_model(model, backend="torch")
    return model


def _gdn2():
    from rewy_hf.models.gdn2 import GDN2Config, GDN2ForCausalLM

    torch.manual_seed(0)
    config = GDN2Config(vocab_size=tiny.VOCAB, hidden_size=tiny.HIDDEN, num_hidden_layers=2, num_heads=2, head_dim=16,
                        fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False, use_short_conv=False)
    model = GDN2ForCausalLM(config).train()
    rewy_hf.patch_model(model, backend="torch")
    return model


def _row_inputs(model, bounds):
    """The keyword arguments of a hybrid's call on the row ``bounds`` inside ``context_parallel``."""
    cu = torch.tensor(bounds)
    return dict(position_ids=RowAttention(cu, dist.group.WORLD).positions("cpu"),
                attention_mask=causal_only_masks(model))


def _alone(model, ids, bounds):
    """Each sequence of the row run on its own: the reference a packed row must equal."""
    return torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(bounds, bounds[1:])], dim=1)


def test_refuses_an_unpatched_model():
    with pytest.raises(UnsupportedConfigError, match="call rewy_hf.patch_model"):
        with rewy_hf.context_parallel(tiny.build("gated_deltanet"), _context([0, 8])):
            pass


@pytest.mark.parametrize("family,layer", [("qwen3_5", "Qwen3_5Attention"), ("kimi_linear", "KimiLinearAttention")])
def test_transformers_hybrids_need_the_rows_bounds(family, layer):
    """Their attention layers attend over the whole row, so they need its sequence bounds (the split
    runs in tests/ops/test_context_parallel.py)."""
    model = H.build(family)
    rewy_hf.patch_model(model, backend="torch")
    with pytest.raises(UnsupportedConfigError, match=re.escape(f"has attention layers ({layer}); pass cu_seqlens=")):
        with rewy_hf.context_parallel(model, _context([0, 8])):
            pass


def test_indexed_attention_is_refused():
    """Sparse (indexed) attention is not dense causal attention: an all-gather of keys and values
    followed by causal SDPA would compute something else."""
    model = H.build("qwen4_exp")
    rewy_hf.patch_model(model, backend="torch")
    with pytest.raises(UnsupportedConfigError, match=r"model.layers.1.self_attn \(\w+\) is neither a patched delta-rule "
                                                     r"layer nor a transformers full_attention layer"):
        with rewy_hf.context_parallel(model, _context([0, 8]), cu_seqlens=torch.tensor([0, 8])):
            pass


def test_attention_implementation_is_the_rows_inside_only():
    from rewy_hf.patching import context_parallel_attention as cpa

    model = H.build("qwen3_5")
    rewy_hf.patch_model(model, backend="torch")
    before = model.config._attn_implementation
    with rewy_hf.context_parallel(model, _context([0, 3, 8]), cu_seqlens=torch.tensor([0, 3, 8])):
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
        with rewy_hf.context_parallel(model, _context([0, 8])):
            pass


def test_short_convolution_gets_the_context_inside_only(monkeypatch):
    """FLA's layers' convolution: inside the block it exchanges with the context (on the CPU through
    rewy's exchange, since FLA's does not run in Triton's interpreter); outside, FLA's own runs
    without one."""
    from rewy_hf.kernels import context_parallel_conv

    seen, exchanged = [], []
    real = context_parallel_conv.cp_causal_short_conv

    def spy(*args, cp_context=None, **kwargs):
        seen.append(cp_context)
        return tiny.torch_causal_conv1d(*args, **kwargs)

    def exchange_spy(x, weight, bias, activation, call):
        exchanged.append(call)
        return real(x, weight, bias, activation, call)

    for name in ("fla.modules.causal_conv1d.ops", "fla.layers.gated_deltanet"):
        monkeypatch.setattr(importlib.import_module(name), "causal_conv1d", spy)
    monkeypatch.setattr(context_parallel_conv, "cp_causal_short_conv", exchange_spy)
    model = tiny.build("gated_deltanet")
    rewy_hf.patch_model(model, backend="torch")
    ids = torch.randint(0, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    ctx = _context([0, 8])
    with rewy_hf.context_parallel(model, ctx):
        inside = model(input_ids=ids, cu_seqlens=ctx.cu_seqlens).logits
    assert exchanged and all(c.fla_context is ctx for c in exchanged) and not seen
    exchanged.clear()
    outside = model(input_ids=ids, cu_seqlens=ctx.cu_seqlens).logits
    assert seen and all(c is None for c in seen) and not exchanged
    # One rank: its sequence starts from the zero state it starts from outside.
    torch.testing.assert_close(inside, outside, rtol=1e-6, atol=1e-6)


def test_transformers_convolution_is_the_context_parallel_one_inside_only(monkeypatch):
    """On one rank the context-parallel convolution borrows nothing; with the context's packed bounds
    it restarts at each sequence, as each sequence run alone does."""
    from rewy_hf.kernels import context_parallel_conv
    from rewy_hf.kernels.context_parallel_call import CPCall

    calls = []
    real = context_parallel_conv.cp_causal_short_conv
    monkeypatch.setattr(context_parallel_conv, "cp_causal_short_conv",
                        lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    model = H.delta_rule_only("qwen3_5")
    rewy_hf.patch_model(model, backend="torch")
    ids = H.input_ids(1, 40)
    ctx = _context([0, 17, 40])
    with rewy_hf.context_parallel(model, ctx):
        packed = model(input_ids=ids).logits
    # one per layer, each with the context as a CPCall of its bounds
    assert len(calls) == 2 and all(isinstance(c, CPCall) and c.cu_seqlens is ctx.cu_seqlens for c in calls)
    calls.clear()
    alone = torch.cat([model(input_ids=ids[:, :17]).logits, model(input_ids=ids[:, 17:]).logits], dim=1)
    assert not calls
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


# ------------------------------------------------ contexts and bounds that do not describe one row


def _model_and_row(kind: str, bounds):
    """A patched model of ``kind`` ("hybrid": Qwen3.5 with an attention layer, "gdn2": delta-rule
    layers only), the keywords ``context_parallel`` takes for it on the row ``bounds``, and the ones
    its call takes inside."""
    if kind == "hybrid":
        model = _hybrid()
        return model, dict(cu_seqlens=torch.tensor(bounds)), _row_inputs(model, bounds)
    return _gdn2(), {}, dict(cu_seqlens=torch.tensor(bounds))


@pytest.mark.parametrize("kind", ["hybrid", "gdn2"])
def test_row_bounds_other_than_the_contexts_are_refused(kind):
    """The attention layers would keep other sequences apart than the delta-rule layers; with the
    context's own bounds the row runs and equals its sequences run alone."""
    model, row, inputs = _model_and_row(kind, [0, 3, 8])
    ctx = _context([0, 3, 8])
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            "cu_seqlens=[0, 5, 8] are not the bounds cp_context was built from: they give rank 0 of 1 the local "
            "bounds [0, 5, 8], while cp_context holds [0, 3, 8]; pass context_parallel the cu_seqlens")):
        with rewy_hf.context_parallel(model, ctx, cu_seqlens=torch.tensor([0, 5, 8])):
            pass
    ids = H.input_ids(1, 8)
    with rewy_hf.context_parallel(model, ctx, cu_seqlens=torch.tensor([0, 3, 8])):
        logits = model(input_ids=ids, **inputs).logits
    torch.testing.assert_close(logits, _alone(model, ids, [0, 3, 8]), rtol=1e-5, atol=1e-5)


def test_a_hybrid_called_without_position_ids_is_refused():
    """Without them each rank numbers its slice from 0, and keys gathered from the ranks before meet
    its queries at the wrong distances; with them the row equals its sequences run alone, and
    outside the block the model numbers its tokens itself again."""
    model, row, inputs = _model_and_row("hybrid", [0, 3, 8])
    ids = H.input_ids(1, 8)
    with rewy_hf.context_parallel(model, _context([0, 3, 8]), **row):
        with pytest.raises(UnsupportedConfigError, match=re.escape(
                "context_parallel: Qwen3_5ForCausalLM was called without position_ids, but its attention layers "
                "attend over the whole row")):
            model(input_ids=ids, attention_mask=inputs["attention_mask"])
        logits = model(input_ids=ids, **inputs).logits
    torch.testing.assert_close(logits, _alone(model, ids, [0, 3, 8]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(input_ids=ids[:, :3]).logits, logits[:, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,fragment", [
    ("hybrid", "cu_seqlens=[0, 6, 3, 8] must start at 0 and never decrease"),
    ("gdn2", "this rank's cp_context cannot come from one packed row: its local bounds [0, 6, 3, 8] do not run from 0 "
             "up to this rank's token count"),
])
def test_unsorted_bounds_are_refused(kind, fragment):
    """FLA builds a context from them all the same; rewy's build_cp_context refuses them first."""
    model, row, _ = _model_and_row(kind, [0, 6, 3, 8])
    with pytest.raises(UnsupportedConfigError, match=re.escape(fragment)):
        with rewy_hf.context_parallel(model, _context([0, 6, 3, 8]), **row):
            pass
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            "build_cp_context: cu_seqlens=[0, 6, 3, 8] must start at 0 and never decrease")):
        rewy_hf.build_cp_context(torch.tensor([0, 6, 3, 8]), dist.group.WORLD)


def test_every_rank_refuses_contexts_that_do_not_describe_one_row():
    """Two ranks (tests/support/cp_ranks.py): unsorted bounds, contexts built from different rows,
    row bounds that contradict the context on one rank only, and different row bounds per rank are
    refused on both ranks (a rank that passed its own checks stops too, rather than wait in an
    exchange); a consistent row enters on both."""
    mp.spawn(refusal_rank_main, args=(2, free_port(), [()]), nprocs=2, join=True)


@pytest.mark.parametrize("kind", ["hybrid", "gdn2"])
def test_a_context_without_a_process_group_is_refused(kind):
    """FLA makes one (its ranks given by number): rank 1's slice would run alone from a zero state."""
    from fla.ops.cp.context import get_cp_cu_seqlens

    ctx = get_cp_cu_seqlens(torch.tensor([0, 3, 8]), world_size=2, rank=1)
    assert ctx.group is None
    model, row, _ = _model_and_row(kind, [0, 3, 8])
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            "context_parallel: cp_context has no process group (group=None), so no rank could receive the state of "
            "the sequences it continues. Build it with fla.ops.cp.build_cp_context(cu_seqlens, group=<the "
            "context-parallel process group>)")):
        with rewy_hf.context_parallel(model, ctx, **row):
            pass


@pytest.mark.parametrize("kind", ["hybrid", "gdn2"])
def test_a_rank_given_more_tokens_than_its_slice_is_told_to_pass_its_slice(kind):
    """Not the core's complaint about cu_seqlens, which the caller never passed: the transformers
    hybrid's convolution and GDN2's core both say the rank's slice."""
    model, row, _ = _model_and_row(kind, [0, 3, 8])
    ids = H.input_ids(1, 16)
    inputs = (dict(position_ids=torch.arange(16)[None], attention_mask=causal_only_masks(model)) if kind == "hybrid"
              else {})
    with rewy_hf.context_parallel(model, _context([0, 3, 8]), **row):
        with pytest.raises(InputValidationError, match=re.escape(
                "context parallelism: this rank's inputs hold 16 tokens (the whole row?), but cp_context gives it a "
                "slice of 8 tokens of the packed row. Pass each rank only its own slice, tokens [rank * 8, "
                "(rank + 1) * 8) of the row")):
            model(input_ids=ids, **inputs)


def test_build_cp_context_names_the_missing_group():
    """FLA's fails on an assertion without a message."""
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            "build_cp_context: group=None; a context-parallel context needs the process group whose ranks share "
            "the row: pass group=torch.distributed.group.WORLD (every rank) or the subgroup that splits the row")):
        rewy_hf.build_cp_context(torch.tensor([0, 8]), None)
    ctx = rewy_hf.build_cp_context(torch.tensor([0, 3, 8]), dist.group.WORLD)
    assert ctx.group is dist.group.WORLD and ctx.cu_seqlens.tolist() == [0, 3, 8]


def test_every_consistent_row_passes_the_checks():
    """No false refusal: for rows with empty sequences, bounds on slice edges and sequences across
    several ranks, each rank's FLA context is the view the checks expect from the row's bounds, and
    the ranks' views chain."""
    from fla.ops.cp.context import get_cp_cu_seqlens

    from rewy_hf.patching.context_parallel_checks import chain_fault, record, view_of

    gen = torch.Generator().manual_seed(0)
    for world in (2, 3, 4):
        for part in (1, 3, 8):
            for _ in range(40):
                T = world * part
                inner = sorted(torch.randint(0, T + 1, (int(torch.randint(0, 6, (), generator=gen)),),
                                             generator=gen).tolist())
                row = [0, *inner, T]
                records = []
                for rank in range(world):
                    ctx = get_cp_cu_seqlens(torch.tensor(row), world_size=world, rank=rank)
                    local = ctx.cu_seqlens_cpu.tolist()
                    meta = [int(ctx.is_first_rank), int(ctx.is_last_rank), ctx.pre_num_ranks, ctx.post_num_ranks,
                            ctx.pre_num_conv_tokens]
                    assert view_of(row, world, rank) == (local, meta), (row, world, rank)
                    records.append(record(False, local, meta, row))
                assert chain_fault(torch.tensor(records)) is None, (row, world)
