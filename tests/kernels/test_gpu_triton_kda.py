"""The triton backend of KDA and GDN2 on CUDA (GPU only), through the public ops.

BF16 inputs, log-sigmoid gates; the reference is rewy's torch backend on the same
values in float32. FLA's own KDA / GDN2 backward runs on the H200 (no guard), so
ours must be no less accurate than FLA's (within 10 %, plus a small floor)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu


def _inputs(op, B, T, H, K, V, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(B, T, H, K).bfloat16(), F.normalize(r(B, T, H, K), dim=-1).bfloat16(), r(B, T, H, V).bfloat16()
    g = F.logsigmoid(r(B, T, H, K))
    if op == "kda":
        extra = [torch.rand(B, T, H, device="cuda", generator=gen)]
    else:
        # b and w in the model dtype, as FLA's GDN-2 layer passes them (its kernels need w_gate and v in one dtype)
        extra = [torch.rand(B, T, H, K, device="cuda", generator=gen).bfloat16(),
                 torch.rand(B, T, H, V, device="cuda", generator=gen).bfloat16()]
    return [q, k, v, g, *extra], dict(initial_state=0.3 * r(B, H, K, V), output_final_state=True)


def _grads(fn, args, kw, do, dht, params=None):
    """Gradients of ``args``, of the keyword tensors ``params`` (e.g. A_log, dt_bias) and of
    kw's initial state, in that order."""
    leaves = [a.detach().requires_grad_() for a in args]
    named = {n: p.detach().requires_grad_() for n, p in (params or {}).items()}
    h0 = kw["initial_state"].detach().requires_grad_()
    o, ht = fn(*leaves, **{**kw, **named, "initial_state": h0})
    return list(torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves + list(named.values()) + [h0]))


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_triton_matches_fp32_reference_and_fla(op, policy):
    B, T, H, K, V = 2, 700, 4, 128, 128
    args, kw = _inputs(op, B, T, H, K, V)
    ours_fn = rewy_hf.chunk_kda if op == "kda" else rewy_hf.chunk_gdn2
    if op == "kda":
        from fla.ops.kda import chunk_kda as fla_fn
    else:
        from fla.ops.gdn2 import chunk_gdn2 as fla_fn
    do, dht = torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")
    ref = _grads(lambda *a, **k: ours_fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: ours_fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    theirs = _grads(lambda *a, **k: fla_fn(*a, disable_recompute=policy == "full", **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    fla_errs = [rel_err(x, r) for x, r in zip(theirs, ref)]
    assert all(e <= 1.1 * f + 1e-3 for e, f in zip(errs, fla_errs)), (errs, fla_errs)


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_kda_as_fla_kda_layer_calls_it(policy):
    """The call FLA's KDA layer (and so Kimi-Linear) makes: GVA (4 value heads per
    2 key heads), the V-first state layout, q/k l2norm, the gate from A_log and
    dt_bias and the beta sigmoid in the op. Gradients of every input, the gate
    parameters and the initial state, against the fp32 torch backend and no
    worse than FLA's own (within 10 %)."""
    from fla.ops.kda import chunk_kda as fla_fn

    B, T, H, HV, K, V = 2, 333, 2, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    args = [r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16(), r(B, T, HV, V).bfloat16(), r(B, T, HV, K),
            r(B, T, HV)]
    params = dict(A_log=torch.log(torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen)),
                  dt_bias=0.5 * r(HV * K))
    kw = dict(initial_state=0.3 * r(B, HV, V, K), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, state_v_first=True, output_final_state=True)
    do, dht = torch.randn(B, T, HV, V, device="cuda"), torch.randn(B, HV, V, K, device="cuda")
    ref = _grads(lambda *a, **k: rewy_hf.chunk_kda(*a, backend="torch", **k), [a.float() for a in args], kw, do,
                 dht, params)
    ours = _grads(lambda *a, **k: rewy_hf.chunk_kda(*a, backend="triton", policy=policy, **k), args, kw, do, dht,
                  params)
    theirs = _grads(lambda *a, **k: fla_fn(*a, disable_recompute=policy == "full", **k), args, kw, do, dht, params)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    fla_errs = [rel_err(x, r) for x, r in zip(theirs, ref)]
    assert max(errs) < 2e-2, (errs, fla_errs)
    assert all(e <= 1.1 * f + 1e-3 for e, f in zip(errs, fla_errs)), (errs, fla_errs)


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_gate_saturated_at_the_safe_lower_bound(op, policy):
    """The gate a Kimi-style layer computes in the op with ``lower_bound=-5`` and
    ``safe_gate=True``: -5 * sigmoid(exp(A_log) * (g + dt_bias)), here saturated (about
    -4.8 to -5 per token), where the intra-chunk decays span the widest range that the
    safe gate allows. Gradients of every input and of A_log, dt_bias against the fp32
    torch backend, and no worse than FLA's own (within 10 %)."""
    B, T, H, K, V = 2, 333, 2, 128, 128
    args, kw = _inputs(op, B, T, H, K, V, seed=8)
    gen = torch.Generator(device="cuda").manual_seed(9)
    args[3] = 3.0 + torch.randn(B, T, H, K, device="cuda", generator=gen)          # raw gate input
    params = dict(A_log=torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen)),
                  dt_bias=0.1 * torch.randn(H * K, device="cuda", generator=gen))
    kw.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    ours_fn = rewy_hf.chunk_kda if op == "kda" else rewy_hf.chunk_gdn2
    if op == "kda":
        from fla.ops.kda import chunk_kda as fla_fn
    else:
        from fla.ops.gdn2 import chunk_gdn2 as fla_fn
    do, dht = torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")
    ref = _grads(lambda *a, **k: ours_fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht, params)
    ours = _grads(lambda *a, **k: ours_fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht, params)
    theirs = _grads(lambda *a, **k: fla_fn(*a, disable_recompute=policy == "full", **k), args, kw, do, dht, params)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    fla_errs = [rel_err(x, r) for x, r in zip(theirs, ref)]
    # FLA's gradients near the reference too: rewy's gate is the one FLA computes
    assert max(errs) < 2e-2 and max(fla_errs) < 2e-2, (errs, fla_errs)
    assert all(e <= 1.1 * f + 1e-3 for e, f in zip(errs, fla_errs)), (errs, fla_errs)


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_triton_packed_sequences(op, policy):
    """cu_seqlens (three sequences in one row, an initial state each) against the fp32
    torch backend and no worse than FLA's own packed backward (within 10 %). Its pass
    on the H200 is why ``auto`` takes the Triton backend for packed KDA/GDN2 calls."""
    lengths = [200, 64, 333]
    T, H, K, V = sum(lengths), 2, 128, 128
    args, kw = _inputs(op, 1, T, H, K, V, seed=4)
    kw["initial_state"] = 0.3 * torch.randn(len(lengths), H, K, V, device="cuda")
    kw["cu_seqlens"] = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    ours_fn = rewy_hf.chunk_kda if op == "kda" else rewy_hf.chunk_gdn2
    if op == "kda":
        from fla.ops.kda import chunk_kda as fla_fn
    else:
        from fla.ops.gdn2 import chunk_gdn2 as fla_fn
    do, dht = torch.randn(1, T, H, V, device="cuda"), torch.randn(len(lengths), H, K, V, device="cuda")
    ref = _grads(lambda *a, **k: ours_fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: ours_fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    theirs = _grads(lambda *a, **k: fla_fn(*a, disable_recompute=policy == "full", **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    fla_errs = [rel_err(x, r) for x, r in zip(theirs, ref)]
    assert max(errs) < 2e-2, errs
    assert all(e <= 1.1 * f + 1e-3 for e, f in zip(errs, fla_errs)), (errs, fla_errs)


@pytest.mark.parametrize("op,state_v_first,packed", [("kda", False, False), ("kda", True, False), ("gdn2", False, True)])
def test_state_checkpoints_match_fp32_reference_and_the_sequential_rebuild(op, state_v_first, packed, monkeypatch):
    """Policy recompute with the states rebuilt from checkpoints (triton_backend/state_checkpoints.py,
    2-chunk segments), against the fp32 torch backend and no less accurate (within 10 %)
    than the sequential rebuild."""
    from rewy_hf.kernels.triton_backend import state_checkpoints
    B, T, H, K, V = (1, 1100, 2, 128, 128) if packed else (2, 700, 2, 128, 128)
    args, kw = _inputs(op, B, T, H, K, V, seed=12)
    N = 3 if packed else B
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 130, 900, 1100], device="cuda")
    state = (N, H, V, K) if state_v_first else (N, H, K, V)
    kw.update(initial_state=0.3 * torch.randn(*state, device="cuda"), state_v_first=state_v_first)
    do, dht = torch.randn(B, T, H, V, device="cuda"), torch.randn(*state, device="cuda")
    fn = rewy_hf.chunk_kda if op == "kda" else rewy_hf.chunk_gdn2
    ref = _grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    errs = {}
    for mode in ("off", "2"):
        with pytest.MonkeyPatch.context() as mp:
            if mode == "off":
                mp.setattr(state_checkpoints, "plan", lambda *_: None)
            else:
                mp.setattr(state_checkpoints, "chunks_per_segment", lambda *_: 2)
                mp.setattr(state_checkpoints, "MIN_CHUNKS", 2)        # the shortest segment, which bounds their count
            ours = _grads(lambda *a, **k: fn(*a, backend="triton", policy="recompute", **k), args, kw, do, dht)
        errs[mode] = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs["2"]) < 2e-2, errs
    assert all(e <= 1.1 * s + 1e-3 for e, s in zip(errs["2"], errs["off"])), errs
