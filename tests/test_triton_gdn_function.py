"""The whole triton-backend Function of GDN / DeltaNet on CPU, under TRITON_INTERPRET=1.

FLA's forward stages (gate cumsum, intra-chunk WY, output, local dv) run in the
interpreter; its two sequential state recurrences do not (their loop indices are
plain ints there), so each test replaces them: by rewy's sequence-parallel
recurrences (REWY_HF_SEQUENCE_PARALLEL, with FLA's made to fail), or, for packed
sequences, by the small torch loops below. Everything else is the code that runs
on the GPU. The reference is rewy's torch backend on the same float32 inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.kernels import triton_gdn
from rewy_hf.rel_error import rel_err


def _chunks(T, cu_seqlens):
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    return [(s, min(s + 64, e)) for b, e in zip(bounds[:-1], bounds[1:]) for s in range(b, e, 64)], bounds


def _loop_fwd_h(k, w, u, g=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """FLA's fwd_h in torch: h[c] = state entering chunk c; v_new = u - w h; S' = e^{g_C} S + (k e^{g_C-g})^T v_new."""
    _, T, HV, K = w.shape
    V = u.shape[-1]
    k = k.repeat_interleave(HV // k.shape[2], dim=2)
    chunks, bounds = _chunks(T, cu_seqlens)
    h, vn, finals = torch.zeros(1, len(chunks), HV, K, V), torch.zeros_like(u), []
    seq, S = -1, None
    for i, (s, e) in enumerate(chunks):
        if s in bounds[:-1]:
            seq += 1
            if S is not None:
                finals.append(S)
            S = torch.zeros(HV, K, V) if initial_state is None else initial_state[seq].clone()
        h[0, i] = S
        vn[0, s:e] = u[0, s:e] - torch.einsum("thk,hkv->thv", w[0, s:e], S)
        gl = g[0, e - 1] if g is not None else torch.zeros(HV)
        decay = torch.exp2(gl - g[0, s:e]) if g is not None else torch.ones(e - s, HV)
        S = S * torch.exp2(gl)[:, None, None] + torch.einsum("thk,thv->hkv", k[0, s:e], vn[0, s:e] * decay[..., None])
    finals.append(S)
    return h, vn, torch.stack(finals) if output_final_state else None


def _loop_bwd_dhu(q, k, w, do, dv, g=None, h0=None, dht=None, scale=None, cu_seqlens=None, **_):
    """FLA's bwd_dhu in torch: dh[c] = gradient of the state leaving chunk c; dv2 = dv + (k e^{g_C-g}) dh."""
    _, T, HV, K = w.shape
    V = do.shape[-1]
    q, k = (x.repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
    chunks, bounds = _chunks(T, cu_seqlens)
    dh, dv2, firsts = torch.zeros(1, len(chunks), HV, K, V), torch.zeros_like(dv), []
    seq, D = len(bounds) - 1, None
    for i in reversed(range(len(chunks))):
        s, e = chunks[i]
        if e in bounds[1:]:
            seq -= 1
            D = torch.zeros(HV, K, V) if dht is None else dht[seq].clone()
        dh[0, i] = D
        gl = g[0, e - 1] if g is not None else torch.zeros(HV)
        decay = torch.exp2(gl - g[0, s:e]) if g is not None else torch.ones(e - s, HV)
        qg = q[0, s:e] * (torch.exp2(g[0, s:e])[..., None] if g is not None else 1.0)
        dv2[0, s:e] = dv[0, s:e] + torch.einsum("thk,hkv->thv", k[0, s:e], D) * decay[..., None]
        D = (D * torch.exp2(gl)[:, None, None] + scale * torch.einsum("thk,thv->hkv", qg, do[0, s:e])
             - torch.einsum("thk,thv->hkv", w[0, s:e], dv2[0, s:e]))
        if s in bounds[:-1]:
            firsts.insert(0, D)
    return dh, torch.stack(firsts), dv2


def _replace_recurrences(monkeypatch, fwd_h, bwd_dhu):
    """FLA's two recurrences replaced; rewy's own launch of FLA's kernels (on by default where B x H
    is small, kernels/state_launch.py, and everywhere with REWY_HF_DIRECT_LAUNCH=1) is switched
    off, so the replacements are what run."""
    stages = triton_gdn._fla
    monkeypatch.setenv("REWY_HF_STATE_BLOCK_V", "fla")
    monkeypatch.setenv("REWY_HF_DIRECT_LAUNCH", "0")

    def patched():
        f = stages()
        f["fwd_h"], f["bwd_dhu"] = fwd_h, bwd_dhu
        return f

    monkeypatch.setattr(triton_gdn, "_fla", patched)


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
    _replace_recurrences(monkeypatch, _refuse, _refuse)
    monkeypatch.setenv("REWY_HF_SEQUENCE_PARALLEL", "2")
    monkeypatch.setenv("REWY_HF_DIRECT_LAUNCH", direct)
    H = 1 if op == "gdn" else 2                        # GVA for GDN (DeltaNet has none); five chunks
    inputs, do, dht = _inputs(op, T=300, H=H, HV=2, K=32, V=32, N=1, seed=11)
    _compare(op, inputs, do, dht, policy)


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_packed_sequences(policy, monkeypatch):
    _replace_recurrences(monkeypatch, _loop_fwd_h, _loop_bwd_dhu)
    cu = torch.tensor([0, 70, 200, 230])
    inputs, do, dht = _inputs("gdn", T=230, H=2, HV=2, K=32, V=16, N=3, seed=12)
    _compare("gdn", inputs, do, dht, policy, cu_seqlens=cu)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
def test_function_with_fused_prestage(op, packed, monkeypatch):
    """REWY_HF_FUSED_PRESTAGE=1, policy recompute: w, u and the local dv come from rewy's one
    kernel (kernels/triton_gdn_prestage.py), and FLA's two stages do not run; GVA for GDN."""
    _replace_recurrences(monkeypatch, _loop_fwd_h, _loop_bwd_dhu)
    monkeypatch.setenv("REWY_HF_FUSED_PRESTAGE", "1")
    monkeypatch.setattr(triton_gdn.fla_stages, "recompute_w_u", _refuse_stage)
    monkeypatch.setattr(triton_gdn.fla_stages, "dv_local", _refuse_stage)
    cu = torch.tensor([0, 70, 200, 230]) if packed else None
    inputs, do, dht = _inputs(op, T=230, H=1 if op == "gdn" else 2, HV=2, K=32, V=16, N=3 if packed else 1,
                              seed=16)
    _compare(op, inputs, do, dht, "recompute", cu_seqlens=cu)


def _refuse_stage(*_, **__):
    raise AssertionError("FLA's w/u recompute or local dv ran with REWY_HF_FUSED_PRESTAGE=1")


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_normalises_q_and_k_inside(policy, monkeypatch):
    """qk_l2norm (FLA's use_qk_l2norm_in_kernel): raw q and k go in, the l2norm and its
    gradient run inside the function; GVA, ragged T."""
    _replace_recurrences(monkeypatch, _loop_fwd_h, _loop_bwd_dhu)
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
        h, v_new, ht = _loop_fwd_h(k.float(), w.float(), u.float(), **kw)
        return h.to(k.dtype), v_new.to(u.dtype), ht             # FLA's fwd_h returns both in k's dtype

    _replace_recurrences(monkeypatch, fwd_h_half, _refuse)
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
