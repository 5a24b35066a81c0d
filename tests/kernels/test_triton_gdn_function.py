"""The whole triton-backend Function of GDN / DeltaNet on CPU, under TRITON_INTERPRET=1.

FLA's forward stages (gate cumsum, intra-chunk WY, output, local dv) run in the
interpreter; its two sequential state recurrences do not (their loop indices are
plain ints there), so each test replaces them: by rewy's sequence-parallel
recurrences (REWY_HF_SEQUENCE_PARALLEL, with FLA's made to fail), or, for packed
sequences, by the small torch loops of state_loops.py. Everything else is the code that runs
on the GPU. The reference is rewy's torch backend on the same float32 inputs.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.kernels import triton_gdn
from rewy_hf.rel_error import rel_err
from state_loops import loop_bwd_dhu, loop_fwd_h, replace_recurrences


def _refuse(*_, **__):
    raise AssertionError("FLA's sequential state recurrence ran")


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


def _compare(op, inputs, do, dht, policy, cu_seqlens=None, qk_l2norm=False):
    K = inputs[0].shape[-1]
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    q, k, v, g, beta, h0 = leaves
    o, ht = triton_gdn.triton_gdn_core(q, k, v, g, beta, K ** -0.5, h0, True, False, policy, cu_seqlens, qk_l2norm)
    ref_leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    rq, rk, rv, rg, rb, rh0 = ref_leaves
    kw = dict(scale=K ** -0.5, initial_state=rh0, output_final_state=True, backend="torch", cu_seqlens=cu_seqlens,
              use_qk_l2norm_in_kernel=qk_l2norm)
    if op == "gdn":
        o_ref, ht_ref = rewy_hf.chunk_gated_delta_rule(rq, rk, rv, rg, rb, **kw)
    else:
        o_ref, ht_ref = rewy_hf.chunk_delta_rule(rq, rk, rv, rb, **kw)
    live = [i for i, t in enumerate(leaves) if t is not None]
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [leaves[i] for i in live])
    ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), [ref_leaves[i] for i in live])
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errors.update({names[i]: rel_err(a, b) for i, a, b in zip(live, grads, ref)})
    assert max(errors.values()) < 2e-5, errors


@pytest.mark.parametrize("direct", ["0", "1"])
@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_with_sequence_parallel_recurrences(op, policy, direct, monkeypatch):
    """Also with REWY_HF_DIRECT_LAUNCH=1: FLA's w/u recompute and local dv and rewy's local kernel
    launched without their autotuner wrappers (kernels/direct_launch.py)."""
    replace_recurrences(monkeypatch, _refuse, _refuse)
    monkeypatch.setenv("REWY_HF_SEQUENCE_PARALLEL", "2")
    monkeypatch.setenv("REWY_HF_DIRECT_LAUNCH", direct)
    H = 1 if op == "gdn" else 2                        # GVA for GDN (DeltaNet has none); five chunks
    inputs, do, dht = _inputs(op, T=300, H=H, HV=2, K=32, V=32, N=1, seed=11)
    _compare(op, inputs, do, dht, policy)


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_packed_sequences(policy, monkeypatch):
    replace_recurrences(monkeypatch, loop_fwd_h, loop_bwd_dhu)
    cu = torch.tensor([0, 70, 200, 230])
    inputs, do, dht = _inputs("gdn", T=230, H=2, HV=2, K=32, V=16, N=3, seed=12)
    _compare("gdn", inputs, do, dht, policy, cu_seqlens=cu)


@pytest.mark.parametrize("prestage", ["1", "0"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
def test_function_recompute_prestage_either_way(op, packed, prestage, monkeypatch):
    """Policy recompute. REWY_HF_FUSED_PRESTAGE=1 (the default): w, u and the local dv come from
    rewy's one kernel (kernels/triton_gdn_prestage.py) and FLA's two stages do not run; 0: FLA's two
    stages, and rewy's kernel does not run. GVA for GDN."""
    replace_recurrences(monkeypatch, loop_fwd_h, loop_bwd_dhu)
    monkeypatch.setenv("REWY_HF_FUSED_PRESTAGE", prestage)
    if prestage == "1":
        monkeypatch.setattr(triton_gdn.fla_stages, "recompute_w_u", _refuse_stage)
        monkeypatch.setattr(triton_gdn.fla_stages, "dv_local", _refuse_stage)
    else:
        monkeypatch.setattr(triton_gdn.triton_gdn_prestage, "recompute_wu_and_dv_local", _refuse_stage)
    cu = torch.tensor([0, 70, 200, 230]) if packed else None
    inputs, do, dht = _inputs(op, T=230, H=1 if op == "gdn" else 2, HV=2, K=32, V=16, N=3 if packed else 1,
                              seed=16)
    _compare(op, inputs, do, dht, "recompute", cu_seqlens=cu)


def _refuse_stage(*_, **__):
    raise AssertionError("a stage ran that REWY_HF_FUSED_PRESTAGE switched off")


@pytest.mark.parametrize("prestage", ["1", "0"])
def test_recompute_backward_drops_u_and_the_local_dv_once_read(prestage, monkeypatch):
    """Peak memory: under recompute the backward holds u only until h is rebuilt, and the local
    dv only until the reverse recurrence has folded it into dv2; neither is alive when the
    next stage allocates its outputs (dh, dv2; the local kernel's gradients)."""
    refs = {}
    if prestage == "1":
        produce = triton_gdn.triton_gdn_prestage.recompute_wu_and_dv_local

        def recompute(*a, **kw):
            w, u, dv = produce(*a, **kw)
            refs["u"], refs["dv_local"] = weakref.ref(u), weakref.ref(dv)
            return w, u, dv

        monkeypatch.setattr(triton_gdn.triton_gdn_prestage, "recompute_wu_and_dv_local", recompute)
    else:
        produce_wu, produce_dv = triton_gdn.fla_stages.recompute_w_u, triton_gdn.fla_stages.dv_local

        def recompute(*a, **kw):
            w, u = produce_wu(*a, **kw)
            refs["u"] = weakref.ref(u)
            return w, u

        def dv_local(*a, **kw):
            dv = produce_dv(*a, **kw)
            refs["dv_local"] = weakref.ref(dv)
            return dv

        monkeypatch.setattr(triton_gdn.fla_stages, "recompute_w_u", recompute)
        monkeypatch.setattr(triton_gdn.fla_stages, "dv_local", dv_local)

    def bwd_dhu(**kw):
        assert refs["u"]() is None, "u is still held when the reverse recurrence runs"
        return loop_bwd_dhu(**kw)

    local = triton_gdn.rewy_gdn_bwd_local

    def local_kernel(*a, **kw):
        assert refs["dv_local"]() is None, "the local dv is still held when the local kernel runs"
        refs["local ran"] = True
        return local(*a, **kw)

    replace_recurrences(monkeypatch, loop_fwd_h, bwd_dhu)
    monkeypatch.setenv("REWY_HF_FUSED_PRESTAGE", prestage)
    monkeypatch.setattr(triton_gdn, "rewy_gdn_bwd_local", local_kernel)
    inputs, do, dht = _inputs("gdn", T=130, H=1, HV=2, K=32, V=16, N=1, seed=18)
    _compare("gdn", inputs, do, dht, "recompute")
    assert refs.get("local ran")


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_normalises_q_and_k_inside(policy, monkeypatch):
    """qk_l2norm (FLA's use_qk_l2norm_in_kernel): raw q and k go in, the l2norm and its
    gradient run inside the function; GVA, ragged T."""
    replace_recurrences(monkeypatch, loop_fwd_h, loop_bwd_dhu)
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
        triton_gdn.triton_gdn_core(q, k, v, g, beta, 32 ** -0.5, None, False, False, "recompute", None, True)
    assert [s for s in saved if s[0] == tuple(q.shape)] == [(tuple(q.shape), torch.float16)] * 2, saved
    assert [s for s in saved if s[0] == tuple(q.shape[:-1])] == [(tuple(q.shape[:-1]), torch.float32)] * 2, saved
