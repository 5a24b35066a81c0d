"""The whole triton-backend Function of GDN / DeltaNet on CPU, under TRITON_INTERPRET=1.

FLA's forward stages (gate cumsum, intra-chunk WY, output, local dv) and rewy's kernels
(prestage, reverse walk, local backward) run in the interpreter; FLA's two sequential state
recurrences do not (their loop indices are plain ints there), so each test replaces them by the
small torch loops of tests/support/state_loops.py. Everything else is the code that runs on the
GPU. The reference is rewy's torch backend on the same float32 inputs.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.kernels.triton_backend.scalar_gate import stages
from rewy_hf.kernels import triton_entry
from rewy_hf.rel_error import rel_err
from fake_shapes import watch_saved_like
from state_loops import loop_fwd_h, replace_recurrences


def _refuse(*_, **__):
    raise AssertionError("a stage ran that this path must not run")


@pytest.fixture(autouse=True)
def fake_shapes_checked(monkeypatch):
    """Every Triton forward here also checks the custom op's fake shapes against its saved tensors."""
    watch_saved_like(monkeypatch)


def _inputs(op, T, H, HV, K, V, N, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen)) if op == "gdn" else None
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = torch.randn(N, HV, K, V, generator=gen) * 0.3
    do, dht = torch.randn(1, T, HV, V, generator=gen), torch.randn(N, HV, K, V, generator=gen) * 0.3
    return [q, k, v, g, beta, h0], do, dht


def _compare(op, inputs, do, dht, policy, cu_seqlens=None, qk_l2norm=False, tol=2e-5):
    K = inputs[0].shape[-1]
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    q, k, v, g, beta, h0 = leaves
    o, ht = triton_entry.triton_gdn_core(q, k, v, g, beta, K ** -0.5, h0, True, False, policy, cu_seqlens, qk_l2norm)
    # the ground truth: the torch backend in float64 on the same values
    ref_leaves = [None if t is None else t.double().requires_grad_() for t in inputs]
    rq, rk, rv, rg, rb, rh0 = ref_leaves
    kw = dict(scale=K ** -0.5, initial_state=rh0, output_final_state=True, backend="torch", cu_seqlens=cu_seqlens,
              use_qk_l2norm_in_kernel=qk_l2norm)
    if op == "gdn":
        o_ref, ht_ref = rewy_hf.chunk_gated_delta_rule(rq, rk, rv, rg, rb, **kw)
    else:
        o_ref, ht_ref = rewy_hf.chunk_delta_rule(rq, rk, rv, rb, **kw)
    live = [i for i, t in enumerate(leaves) if t is not None]
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [leaves[i] for i in live])
    ref = torch.autograd.grad((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum(),
                              [ref_leaves[i] for i in live])
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errors.update({names[i]: rel_err(a, b) for i, a, b in zip(live, grads, ref)})
    assert max(errors.values()) < tol, errors


@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_matches_torch_backend(op, policy, monkeypatch):
    """Five chunks, an initial state and dht; GVA for GDN (DeltaNet has none)."""
    replace_recurrences(monkeypatch)
    H = 1 if op == "gdn" else 2
    inputs, do, dht = _inputs(op, T=300, H=H, HV=2, K=32, V=32, N=1, seed=11)
    _compare(op, inputs, do, dht, policy)


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_packed_sequences(policy, monkeypatch):
    replace_recurrences(monkeypatch)
    cu = torch.tensor([0, 70, 200, 230])
    inputs, do, dht = _inputs("gdn", T=230, H=2, HV=2, K=32, V=16, N=3, seed=12)
    _compare("gdn", inputs, do, dht, policy, cu_seqlens=cu)


def test_function_under_strong_decay_and_a_hard_reset(monkeypatch):
    """Log-gates near -10 per token, and -inf (a hard reset) at a chunk's first token and inside a
    chunk: the Triton path floors the log-gates as the torch backend does (no NaN) and keeps the
    gate gradient, which under this decay is the sum of terms e^-10 apart (bound: the float32
    cumulative gates' rounding, which both sides carry)."""
    replace_recurrences(monkeypatch)
    inputs, do, dht = _inputs("gdn", T=200, H=1, HV=2, K=32, V=32, N=1, seed=13)
    g = -10.0 + 0.1 * torch.randn(inputs[3].shape, generator=torch.Generator().manual_seed(5)).clamp(-1, 1)
    g[:, [64, 150]] = float("-inf")
    inputs[3] = g
    _compare("gdn", inputs, do, dht, "recompute", tol=1e-4)


def _watch(monkeypatch, module, name, ran):
    """``module.name`` still runs, and its name is added to ``ran`` when it does."""
    original = getattr(module, name)

    def watched(*a, **kw):
        ran.add(name)
        return original(*a, **kw)

    monkeypatch.setattr(module, name, watched)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_each_policy_runs_its_local_dv_stage_then_the_walk(op, packed, policy, monkeypatch):
    """Under recompute w, u and the local dv come from rewy's fused prestage and FLA's local dv does
    not run; under full FLA's local dv runs and the prestage does not. The reverse recurrence is
    rewy's walk under both (FLA's bwd_dhu made to fail); gradients against the torch backend. GVA
    for GDN."""
    ran = set()
    replace_recurrences(monkeypatch, loop_fwd_h, _refuse)
    _watch(monkeypatch, stages.reverse_walk, "reverse_walk", ran)
    if policy == "recompute":
        _watch(monkeypatch, stages.prestage, "recompute_wu_and_dv_local", ran)
        monkeypatch.setattr(stages.fla_stages, "dv_local", _refuse)
    else:
        _watch(monkeypatch, stages.fla_stages, "dv_local", ran)
        monkeypatch.setattr(stages.prestage, "recompute_wu_and_dv_local", _refuse)
    cu = torch.tensor([0, 70, 200, 230]) if packed else None
    inputs, do, dht = _inputs(op, T=230, H=1 if op == "gdn" else 2, HV=2, K=32, V=16, N=3 if packed else 1,
                              seed=16)
    _compare(op, inputs, do, dht, policy, cu_seqlens=cu)
    assert ran == {"reverse_walk", "recompute_wu_and_dv_local" if policy == "recompute" else "dv_local"}


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_keys_wider_than_the_walk_take_flas_reverse_recurrence(policy, monkeypatch):
    """K = 256 is beyond the walk's two 64-row halves: FLA's bwd_dhu runs (here its torch loop) and the
    walk does not."""
    ran = set()
    replace_recurrences(monkeypatch)
    _watch(monkeypatch, stages.state_launch, "bwd_dhu", ran)
    monkeypatch.setattr(stages.reverse_walk, "reverse_walk", _refuse)
    inputs, do, dht = _inputs("gdn", T=130, H=1, HV=1, K=256, V=16, N=1, seed=17)
    _compare("gdn", inputs, do, dht, policy)
    assert ran == {"bwd_dhu"}


@pytest.mark.parametrize("path", ["recompute", "full"])
def test_backward_drops_u_and_the_local_dv_once_read(path, monkeypatch):
    """Peak memory: under recompute the backward holds u only until h is rebuilt, and the local
    dv only until the reverse walk has folded it into dv2; neither is alive when the next stage
    allocates its outputs (dh, dv2; the local kernel's gradients). Under full, FLA's local dv is
    dropped as soon."""
    refs = {}
    if path == "recompute":
        produce = stages.prestage.recompute_wu_and_dv_local

        def recompute(*a, **kw):
            w, u, dv = produce(*a, **kw)
            refs["u"], refs["dv_local"] = weakref.ref(u), weakref.ref(dv)
            return w, u, dv

        monkeypatch.setattr(stages.prestage, "recompute_wu_and_dv_local", recompute)
    else:
        produce = stages.fla_stages.dv_local

        def dv_local(*a, **kw):
            dv = produce(*a, **kw)
            refs["dv_local"] = weakref.ref(dv)
            return dv

        monkeypatch.setattr(stages.fla_stages, "dv_local", dv_local)
    walk = stages.reverse_walk.reverse_walk

    def reverse_walk(*a, **kw):
        assert "u" not in refs or refs["u"]() is None, "u is still held when the reverse walk runs"
        return walk(*a, **kw)

    monkeypatch.setattr(stages.reverse_walk, "reverse_walk", reverse_walk)
    local = stages.rewy_gdn_bwd_local

    def local_kernel(*a, **kw):
        assert refs["dv_local"]() is None, "the local dv is still held when the local kernel runs"
        refs["local ran"] = True
        return local(*a, **kw)

    replace_recurrences(monkeypatch, loop_fwd_h, _refuse)
    monkeypatch.setattr(stages, "rewy_gdn_bwd_local", local_kernel)
    inputs, do, dht = _inputs("gdn", T=130, H=1, HV=2, K=32, V=16, N=1, seed=18)
    _compare("gdn", inputs, do, dht, path)
    assert refs.get("local ran") and ("u" in refs) == (path != "full")


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_normalises_q_and_k_inside(policy, monkeypatch):
    """qk_l2norm (FLA's use_qk_l2norm_in_kernel): raw q and k go in, the l2norm and its
    gradient run inside the function; GVA, ragged T."""
    replace_recurrences(monkeypatch)
    inputs, do, dht = _inputs("gdn", T=130, H=1, HV=2, K=32, V=16, N=1, seed=13)
    gen = torch.Generator().manual_seed(14)
    inputs[0] = 3 * torch.randn(inputs[0].shape, generator=gen)
    inputs[1] = 0.5 * torch.randn(inputs[1].shape, generator=gen)
    _compare("gdn", inputs, do, dht, policy, qk_l2norm=True)


def test_function_with_qk_l2norm_keeps_only_normalised_q_k_and_row_norms(monkeypatch):
    """What the recompute policy keeps for backward with qk_l2norm: the normalised q and
    k in their dtype and one float32 per row each -- no other tensor of q's shape (a float32
    copy of q or k per layer is what made a patched Qwen3.5 step larger)."""
    def fwd_h_half(k, w, u, **kw):
        h, v_new, ht = loop_fwd_h(k=k.float(), w=w.float(), u=u.float(), **kw)
        return h.to(k.dtype), v_new.to(u.dtype), ht             # FLA's fwd_h returns both in k's dtype

    replace_recurrences(monkeypatch, fwd_h_half, _refuse)
    (q, k, v, g, beta, h0), _, _ = _inputs("gdn", T=130, H=1, HV=2, K=32, V=16, N=1, seed=15)
    q, k, v, beta = (x.half().requires_grad_() for x in (q, k, v, beta))     # beta in their dtype, as FLA takes it
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        triton_entry.triton_gdn_core(q, k, v, g, beta, 32 ** -0.5, None, False, False, "recompute", None, True)
    assert [s for s in saved if s[0] == tuple(q.shape)] == [(tuple(q.shape), torch.float16)] * 2, saved
    assert [s for s in saved if s[0] == tuple(q.shape[:-1])] == [(tuple(q.shape[:-1]), torch.float32)] * 2, saved
