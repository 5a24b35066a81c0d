"""torch.compile of patched models and of the delta-rule custom ops (CPU, torch backend).

A patched layer compiles without a graph break (its core is the custom op
``torch.ops.rewy.delta_rule`` with a fake implementation and registered
autograd, kernels/core.py), compiled and eager runs agree, the dispatch report
still counts every compiled call, new sequence lengths and packed bounds do not
recompile per value, the op passes ``torch.library.opcheck``, and unpatching a
compiled model is followed by the compiled code. Compiles use the ``aot_eager``
backend (AOT autograd without code generation) to keep the file fast.
"""

from __future__ import annotations

import gc
import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import rewy_hf
import rewy_hf.kernels.core  # noqa: F401  (registers torch.ops.rewy.*)
from rewy_hf import dispatch_report, patch_model, reset_dispatch_report, unpatch_model
from rewy_hf.rel_error import rel_err

import hf_tiny_models as hf


@pytest.fixture(scope="module")
def _frozen_survivors():
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _fresh_dynamo(_frozen_survivors):
    """Each test compiles from scratch (no cached frames, no automatic-dynamic marks from a previous test)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    # Patched models of earlier tests are collected now, not in the middle of this test's compiled
    # runs, so the frame counts below count only this test's compiles. What survives is frozen
    # (until the end of this file): the next test's collection walks only the objects made since,
    # not the whole process (half a second with torch, transformers and FLA loaded).
    gc.collect()
    gc.freeze()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    logging.set_verbosity(level)


def grads_rel(model: nn.Module, ref: nn.Module) -> float:
    """Relative Frobenius error over all parameter gradients together."""
    mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    assert mine.keys() == theirs.keys()
    return grad_dicts_rel({n: p.grad for n, p in mine.items()}, {n: p.grad for n, p in theirs.items()})


def grad_dicts_rel(mine: dict, ref: dict) -> float:
    """Relative Frobenius error over the gradients of ``ref``'s names together (every one present)."""
    num = den = 0.0
    for name, r in ref.items():
        assert r is not None and mine.get(name) is not None, name
        num += (mine[name].double() - r.double()).square().sum().item()
        den += r.double().square().sum().item()
    assert den > 0
    return (num / den) ** 0.5


def op_counts(op: str) -> dict:
    return dispatch_report()["ops"].get(op, {"forward_calls": 0, "optimized_backward_calls": 0, "fallback_calls": 0})


def dense_kimi_linear():
    """A tiny Kimi-Linear with dense MLPs only (transformers' MoE breaks the graph on ``nonzero``)."""
    fam = hf.FAMILIES["kimi_linear"]
    cfg = hf.make_config(fam)
    cfg.mlp_layer_types = ["dense"] * cfg.num_hidden_layers
    torch.manual_seed(hf.SEED)
    model = getattr(fam.modeling, fam.model_class)(cfg)
    hf._init_gates(model, fam, hf.SEED)
    return model.train()


def without_cache(model):
    """No KV / recurrent cache (a training step needs none): less model code to trace."""
    model.config.use_cache = False
    return model


def one_layer_moe_kimi_linear():
    """A tiny Kimi-Linear of one delta-rule layer with an MoE MLP: the least model with both a
    delta-rule layer and transformers' graph breaks (the MoE's) to trace."""
    fam = hf.FAMILIES["kimi_linear"]
    cfg = hf.make_config(fam)
    cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, ["linear_attention"], ["sparse"]
    torch.manual_seed(hf.SEED)
    model = getattr(fam.modeling, fam.model_class)(cfg)
    hf._init_gates(model, fam, hf.SEED)
    return model.train()


BUILDERS = {"qwen3_5": lambda: without_cache(hf.build("qwen3_5")),
            "kimi_linear": lambda: without_cache(dense_kimi_linear())}


# ---------------------------------------------------------------------------
# 1. Compiled = eager, and the compiled calls reach rewy
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(BUILDERS))
def test_fullgraph_compile_matches_eager_and_reaches_rewy(family):
    model = BUILDERS[family]()
    twin = hf.twin(model)
    patch_model(model, backend="torch")
    patch_model(twin, backend="torch")
    layers = len(hf.delta_rule_layer_names(model, family))
    assert layers == 2
    ids = hf.input_ids(2, 77)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)

    reset_dispatch_report()
    loss = hf.loss_of(compiled, ids, family)
    loss.backward()
    counts = op_counts(hf.FAMILIES[family].op)
    assert counts["forward_calls"] == layers, dispatch_report()
    assert counts["optimized_backward_calls"] == layers, dispatch_report()
    assert counts["fallback_calls"] == 0
    assert counts["backends"] == {"torch": layers}

    ref = hf.loss_of(twin, ids, family)
    ref.backward()
    assert rel_err(loss, ref) <= 1e-6
    assert grads_rel(model, twin) <= 1e-5


# ---------------------------------------------------------------------------
# 2. No graph break inside a delta-rule layer (MoE model: transformers breaks elsewhere)
# ---------------------------------------------------------------------------

def _real(path: str) -> str:
    return os.path.realpath(path)


def test_no_graph_break_inside_a_delta_rule_layer():
    family = "kimi_linear"
    fam = hf.FAMILIES[family]
    model = without_cache(one_layer_moe_kimi_linear())   # transformers' expert loop breaks on nonzero
    patch_model(model, backend="torch")
    layer_cls = getattr(fam.modeling, fam.layer_class)
    forward = inspect.unwrap(layer_cls.forward)
    layer_file = _real(inspect.getsourcefile(forward))
    lines, first = inspect.getsourcelines(forward)
    layer_lines = range(first, first + len(lines))
    ours = [_real(str(Path(rewy_hf.__file__).parent)) + os.sep,
            _real(str(Path(rewy_hf.kernels.__file__).parent)) + os.sep]   # rewy_hf/ and the repo's kernels/

    reset_dispatch_report()
    explained = torch._dynamo.explain(model)(input_ids=hf.input_ids(1, 24))
    # The layers really ran inside the traced graphs, and through rewy.
    assert op_counts(fam.op)["forward_calls"] == len(hf.delta_rule_layer_names(model, family))

    # Positive control: the detector sees transformers' MoE breaks, so the checks below are not vacuous.
    assert explained.graph_break_count > 0
    assert explained.break_reasons
    frames = [(_real(f.filename), f.lineno, f.name) for r in explained.break_reasons for f in r.user_stack]
    assert any(path == layer_file for path, _, _ in frames), "no break passes through the modeling file"
    for reason in explained.break_reasons:
        for f in reason.user_stack:
            path = _real(f.filename)
            where = f"{f.filename}:{f.lineno} ({f.name}): {reason.reason}"
            assert not any(path.startswith(root) for root in ours), where
            assert not (path == layer_file and f.lineno in layer_lines), where


# ---------------------------------------------------------------------------
# 3. New sequence lengths do not recompile per length
# ---------------------------------------------------------------------------

def test_new_lengths_do_not_recompile_per_length():
    model = hf.one_layer_qwen3_5()
    patch_model(model, backend="torch")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    for T in (70, 100, 130):
        hf.loss_of(compiled, hf.input_ids(2, T), "qwen3_5").backward()
    # The first call compiles with static shapes; the first new length marks T dynamic and
    # compiles once more; the later length (all > 64, so several chunks) reuses that graph.
    assert counter.frame_count == 2


def test_a_length_marked_dynamic_from_the_start_compiles_once():
    """usage.md's way to train over varying lengths without the one automatic-dynamic recompile:
    mark the token dimension dynamic on the batches."""
    model = hf.one_layer_qwen3_5()
    patch_model(model, backend="torch")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    for T in (70, 100, 130):
        ids = hf.input_ids(2, T)
        torch._dynamo.mark_dynamic(ids, 1)
        hf.loss_of(compiled, ids, "qwen3_5").backward()
    assert counter.frame_count == 1


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("batch,value_heads", [(1, 16), (2, 16), (2, 32)])
def test_triton_fake_implementation_guards_on_no_length(family, policy, batch, value_heads):
    """The Triton backend's fake implementation (traced only; its kernels need a GPU) at the H200's
    launch decisions: at B = 2 and 16 value heads the recompute policy cuts the state rebuild into
    segments from 33 chunks on; a checkpoint count that branched on that, or a checkpoint tensor
    whose leading size could be 1 (B = 1), guarded on T, and a training run over T = 2048 and 4096
    compiled twice."""
    from torch.fx.experimental.proxy_tensor import make_fx

    B, T, H, D = batch, 4096, 16, 128
    gate = (B, T, value_heads) if family == "gdn" else (B, T, value_heads, D)

    def core(q, k, v, g, beta):
        return torch.ops.rewy.delta_rule(q, k, v, g, beta, None, None, None, D ** -0.5, family, policy, False, True,
                                         False, "", "", "triton")

    inputs = [torch.empty(B, T, H, D, dtype=torch.bfloat16), torch.empty(B, T, H, D, dtype=torch.bfloat16),
              torch.empty(B, T, value_heads, D, dtype=torch.bfloat16), torch.empty(gate),
              torch.empty(B, T, value_heads, dtype=torch.bfloat16)]
    graph = make_fx(core, tracing_mode="symbolic")(*inputs)
    q = next(n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder")
    length = q.shape[1].node.expr
    env = q.fake_mode.shape_env
    values = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    others = {s: v for s, v in values.items() if s != length}
    # Every guard the trace left must hold at any length of more than one chunk (sizes of one
    # are specialised, as torch.compile does for any dimension), so one graph serves them all.
    for T_run in (65, 2048, 2049, 4096, 8192, 32 * 64 + 1, 33 * 64, 131072):
        failed = [g.expr for g in env.guards if not g.expr.xreplace({**others, length: T_run})]
        assert not failed, f"T = {T_run}: {failed}"
    assert any(n.target is torch.ops.rewy.delta_rule.default for n in graph.graph.nodes)


def _traced_packed_core(family, policy, value_heads):
    """The Triton backend's forward op traced symbolically (its fake implementation; the kernels need
    a GPU) on a packed row of 4,096 tokens in four sequences, one of them empty."""
    from torch.fx.experimental.proxy_tensor import make_fx

    T, H, D = 4096, 16, 128
    gate = (1, T, value_heads) if family == "gdn" else (1, T, value_heads, D)

    def core(q, k, v, g, beta, cu):
        return torch.ops.rewy.delta_rule(q, k, v, g, beta, None, None, cu, D ** -0.5, family, policy, False, True,
                                         False, "", "", "triton")

    inputs = [torch.empty(1, T, H, D, dtype=torch.bfloat16), torch.empty(1, T, H, D, dtype=torch.bfloat16),
              torch.empty(1, T, value_heads, D, dtype=torch.bfloat16), torch.empty(gate),
              torch.empty(1, T, value_heads, dtype=torch.bfloat16), torch.tensor([0, 1000, 1000, 3000, T])]
    return make_fx(core, tracing_mode="symbolic")(*inputs)


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("value_heads", [16, 32])
def test_triton_fake_implementation_of_packed_calls_has_no_run_time_sizes(family, policy, value_heads):
    """Packed calls on the Triton backend: the saved tensors are sized by bounds of the shapes (T
    and the number of sequences), so the trace has no unbacked size, which torch < 2.13 cannot
    trace through a custom op (the call would break the graph)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    graph = _traced_packed_core(family, policy, value_heads)
    node = next(n for n in graph.graph.nodes if n.target is torch.ops.rewy.delta_rule.default)
    outputs = node.meta["val"]
    assert len(outputs) > 2
    assert not [tuple(x.shape) for x in outputs if free_unbacked_symbols(x.shape)]


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("value_heads", [4, 16, 32])
def test_triton_fake_implementation_of_packed_calls_guards_on_no_sequence_count(family, policy, value_heads):
    """Traced with four packed sequences, every guard the Triton backend's fake implementation leaves
    holds at any number of sequences (and any T of more than one chunk): the checkpoint slots are
    counted without a branch on the count (at 16 value heads, 3 or more sequences fill half an
    H200's SMs and fewer keep checkpoints) and the final state is returned flat, so that no size is
    N alone. Either had the first row of one document compile a training graph again."""
    graph = _traced_packed_core(family, policy, value_heads)
    placeholders = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
    length, bounds = placeholders[0].shape[1].node.expr, placeholders[-1].shape[0].node.expr
    env = placeholders[0].fake_mode.shape_env
    values = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    others = {s: v for s, v in values.items() if s not in (length, bounds)}
    for T_run in (65, 4096, 8192):
        for sequences in (1, 2, 3, 4, 9, 40, T_run // 2):
            at = {**others, length: T_run, bounds: sequences + 1}
            failed = [g.expr for g in env.guards if not g.expr.xreplace(at)]
            assert not failed, f"T = {T_run}, {sequences} sequences: {failed}"


# ---------------------------------------------------------------------------
# 4. Packed sequences: one dynamic graph for different bounds
# ---------------------------------------------------------------------------

def _packed_loss(q, k, v, g, beta, cu):
    o, ht = rewy_hf.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True,
                                           backend="torch")
    return o.sum() + ht.sum()


def test_packed_sequences_compile_once():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_packed_loss, backend=counter, fullgraph=True, dynamic=True)
    for bounds in ([0, 40, 150], [0, 10, 90, 130, 200]):
        T = bounds[-1]
        gen = torch.Generator().manual_seed(T)
        r = lambda *s: torch.randn(*s, generator=gen)
        inputs = [F.normalize(r(1, T, 2, 16), dim=-1), F.normalize(r(1, T, 2, 16), dim=-1), r(1, T, 2, 16),
                  F.logsigmoid(r(1, T, 2)), torch.sigmoid(r(1, T, 2))]
        cu = torch.tensor(bounds, dtype=torch.long)
        mine = [x.clone().requires_grad_() for x in inputs]
        ref = [x.clone().requires_grad_() for x in inputs]
        out = compiled(*mine, cu)
        out.backward()
        expected = _packed_loss(*ref, cu)
        expected.backward()
        assert rel_err(out, expected) <= 1e-6, bounds
        for name, a, b in zip("q k v g beta".split(), mine, ref):
            assert rel_err(a.grad, b.grad) <= 1e-6, (bounds, name)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------
# 5. torch.library.opcheck on the forward op (schema, fake, autograd registration, AOT dynamic)
# ---------------------------------------------------------------------------

def _op_args(family, policy, *, T=70, B=2, H=2, HV=None, K=16, V=16, cu=None, h0=False, v_first=False):
    """torch.ops.rewy.delta_rule's positional arguments, as kernels/core.py's delta_rule builds them:
    q, k, v, g, beta, w, h0, cu_seqlens, then scale, family, policy, state_v_first, qk_l2norm,
    safe_gate, report_as, why, backend. Activated inputs: q and k l2-normalised, log-decay gates, gates
    and betas in (0, 1)."""
    gen = torch.Generator().manual_seed(T + 31 * len(family))
    HV = HV or H
    if cu is not None:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    r = lambda *s: torch.randn(*s, generator=gen)
    u = lambda *s: torch.rand(*s, generator=gen)
    q, k, v = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1), r(B, T, HV, V)
    g = w = None
    if family == "delta_rule":
        beta = u(B, T, HV)
    elif family == "gdn":
        g, beta = F.logsigmoid(r(B, T, HV)), u(B, T, HV)
    elif family == "kda":
        g, beta = F.logsigmoid(r(B, T, HV, K)), u(B, T, HV)
    else:                                    # gdn2: erase gate beta [B, T, H, K], write gate w [B, T, H, V]
        g, beta, w = F.logsigmoid(r(B, T, H, K)), u(B, T, H, K), u(B, T, H, V)
    state = None if not h0 else 0.5 * r(*((N, HV, V, K) if v_first else (N, HV, K, V)))
    tensors = [None if t is None else t.requires_grad_() for t in (q, k, v, g, beta, w, state)]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long)
    return (*tensors, cu_t, K ** -0.5, family, policy, v_first, False, False, "", "", "torch")


OPCHECK_CASES = [pytest.param(f, p, {}, id=f"{f}-{p}") for f in ("delta_rule", "gdn", "kda", "gdn2")
                 for p in ("recompute", "full")] + [
    pytest.param("gdn", "recompute", dict(cu=[0, 40, 150]), id="gdn-packed"),
    pytest.param("kda", "full", dict(h0=True, v_first=True), id="kda-h0-state_v_first"),
    pytest.param("gdn", "recompute", dict(HV=4), id="gdn-gva"),
]


@pytest.mark.parametrize("family,policy,options", OPCHECK_CASES)
def test_opcheck_forward_op(family, policy, options):
    args = _op_args(family, policy, **options)
    result = torch.library.opcheck(torch.ops.rewy.delta_rule.default, args)
    assert result == {name: "SUCCESS" for name in result} and len(result) == 4, result


# ---------------------------------------------------------------------------
# 6. unpatch_model after compile: the compiled model follows the unpatch
# ---------------------------------------------------------------------------

def test_unpatch_after_compile_is_followed():
    family = "qwen3_5"
    model = hf.one_layer_qwen3_5()
    reference = hf.twin(model)              # never patched
    layers = len(hf.delta_rule_layer_names(model, family))
    assert layers == 1
    patch_model(model, backend="torch")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    ids = hf.input_ids(2, 70)
    reset_dispatch_report()
    hf.loss_of(compiled, ids, family).backward()
    assert op_counts(hf.FAMILIES[family].op)["forward_calls"] == layers
    assert counter.frame_count == 1

    assert unpatch_model(model) == layers
    reset_dispatch_report()
    # Forward only: the backward of transformers' own plain-torch core fails under aot_eager on
    # this torch (a view on a non-viewable stride, in transformers' code, unpatched), which is no
    # property of rewy's.
    with hf.reference_core(family):
        loss = hf.loss_of(compiled, ids, family)
        expected = hf.loss_of(reference, ids, family)
    # Dynamo's guards on the swapped module global and the instance forward failed: it recompiled.
    assert counter.frame_count == 2
    assert op_counts(hf.FAMILIES[family].op)["forward_calls"] == 0, dispatch_report()
    assert rel_err(loss, expected) <= 1e-6


# ---------------------------------------------------------------------------
# 7. The state dict of a compiled patched model saves as the unpatched model's
# ---------------------------------------------------------------------------

def test_compiled_patched_state_dict_saves(tmp_path):
    model = hf.build("qwen3_5")
    unpatched = hf.twin(model)
    patch_model(model, backend="torch")
    compiled = torch.compile(model, backend="aot_eager")
    path = tmp_path / "state.pt"
    torch.save(compiled.state_dict(), path)
    saved = torch.load(path, weights_only=True)
    prefix = "_orig_mod."
    assert all(key.startswith(prefix) for key in saved)
    saved = {key[len(prefix):]: value for key, value in saved.items()}
    expected = unpatched.state_dict()
    assert list(saved) == list(expected)
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key


# ---------------------------------------------------------------------------
# The short convolution: fused inside a compiled patched layer
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(BUILDERS))
def test_compiled_patched_layer_runs_the_fused_short_convolution(family):
    """Compiled, a patched layer's convolution is the shifted multiply-add form (kernels/short_conv.py,
    no ``conv1d`` left for inductor to hand to cuDNN), with the eager model's values; eagerly the
    layer's own ``F.conv1d`` runs."""
    model = BUILDERS[family]()
    twin = hf.twin(model)
    patch_model(model, backend="torch")
    patch_model(twin, backend="torch")
    cnt = CompileCounterWithBackend("aot_eager")
    ids = hf.input_ids(2, 50)
    loss = hf.loss_of(torch.compile(model, backend=cnt, fullgraph=True), ids, family)
    loss.backward()
    calls = [str(n.target) for gm in cnt.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert not [c for c in calls if "conv1d" in c], "the compiled patched layer still calls conv1d"

    seen = []
    real = F.conv1d

    def counting(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "conv1d", counting)
        ref = hf.loss_of(twin, ids, family)
    assert len(seen) == 2, "eagerly, each delta-rule layer runs transformers' own F.conv1d"
    ref.backward()
    assert rel_err(loss, ref) <= 1e-6
    assert grads_rel(model, twin) <= 1e-5


def test_the_fused_convolution_stands_in_only_for_transformers_torch_fallback():
    import importlib.util

    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

    from rewy_hf.adapters.transformers_common import runs_torch_fallback

    site = qwen3_5.causal_conv1d_fn
    site = getattr(site, "original", site)                 # under a rewy CoreDispatcher
    assert runs_torch_fallback(site) is (importlib.util.find_spec("causal_conv1d") is None)
    assert not runs_torch_fallback(lambda hidden_states, weight: hidden_states)


# ---------------------------------------------------------------------------
# What users compile together with it: PEFT LoRA, gradient checkpointing, bf16 autocast
# ---------------------------------------------------------------------------

# (dynamo's checkpoint side-effect setting, bf16 autocast, gradient tolerance): in float32 the two
# sides agree to rounding; under bf16 autocast the recompute inside checkpoint's compiled region
# rounds in another order than the eager one, a few bf16 steps (2^-8) apart.
@pytest.mark.parametrize("skip_side_effects,autocast,tol", [(False, False, 1e-5), (True, True, 3e-2)])
def test_compiled_lora_with_checkpointing_and_autocast_matches_eager(skip_side_effects, autocast, tol):
    """A LoRA-wrapped, gradient-checkpointed patched model compiled under bf16 autocast gives the
    eager model's loss and LoRA gradients (both sides run the same bf16 ops; aot_eager fuses none),
    and its delta-rule layer's recomputed forward and backward reach rewy. By default dynamo breaks
    the graph at checkpoint's region (the patched layer's push onto the active-layer stack is a side
    effect there); with ``skip_fwd_side_effects_in_bwd_under_checkpoint`` it compiles through."""
    from torch._dynamo.utils import counters
    from peft import LoraConfig, get_peft_model

    def build():
        model = hf.one_layer_qwen3_5()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(
            hf.FAMILIES["qwen3_5"].lora_targets), init_lora_weights=False))
        patch_model(model, backend="torch")
        return model

    torch.manual_seed(5)
    model = build()
    torch.manual_seed(5)
    twin = build()
    ids = hf.input_ids(2, 70)
    compiled = torch.compile(model, backend="aot_eager")
    reset_dispatch_report()
    counters.clear()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=skip_side_effects):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = hf.loss_of(compiled, ids, "qwen3_5")
    loss.backward()
    counts = op_counts("gated_delta_rule")
    assert counts["optimized_backward_calls"] == 1 and counts["fallback_calls"] == 0, counts
    checkpoint_breaks = [r for r in counters["graph_break"] if "Unsafe side effect" in r]
    assert bool(checkpoint_breaks) is not skip_side_effects, dict(counters["graph_break"])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = hf.loss_of(twin, ids, "qwen3_5")
    ref.backward()
    assert rel_err(loss, ref) <= tol / 10
    lora = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    ref_lora = {n: p.grad for n, p in twin.named_parameters() if n in lora}
    assert grad_dicts_rel(lora, ref_lora) <= tol
