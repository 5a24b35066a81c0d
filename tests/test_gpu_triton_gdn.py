"""The triton backend of GDN and DeltaNet on CUDA (GPU only).

BF16 inputs; the reference is rewy's torch backend on the same values in
float32. For DeltaNet FLA's own backward runs too, and ours must be no less
accurate (within 10 %); FLA's GDN backward refuses to run on Hopper with
Triton < 3.7.1, so GDN is held to the BF16-level bound alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewy_hf

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2


def _inputs(op, B, T, H, HV, K, V, h0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, HV, V)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen)
    args = [q.bfloat16(), k.bfloat16(), v.bfloat16()]
    args += [beta] if op == "delta_rule" else [F.logsigmoid(r(B, T, HV)), beta]
    kw = dict(output_final_state=True)
    if h0:
        kw["initial_state"] = 0.3 * r(B, HV, K, V)
    return args, kw


def _grads(fn, args, kw, do, dht):
    leaves = [a.detach().requires_grad_() for a in args]
    kw = {k: (v.detach().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    o, ht = fn(*leaves, **kw)
    extra = [kw["initial_state"]] if "initial_state" in kw else []
    return [o, ht] + list(torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves + extra))


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op,shape", [
    ("gdn", (2, 300, 2, 4, 128, 128)),       # GVA, ragged T
    ("gdn", (1, 1024, 4, 4, 64, 128)),
    ("delta_rule", (2, 300, 4, 4, 128, 64)),
])
def test_triton_matches_fp32_reference(op, shape, policy):
    B, T, H, HV, K, V = shape
    args, kw = _inputs(op, B, T, H, HV, K, V, h0=True)
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(B, T, HV, V, device="cuda")
    dht = torch.randn(B, HV, K, V, device="cuda")
    ref = _grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    errs = [_rel(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs
    if op == "delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule as fla_delta

        theirs = _grads(fla_delta, args, kw, do, dht)
        fla_errs = [_rel(x, r) for x, r in zip(theirs, ref)]
        assert all(e <= 1.1 * f + 1e-3 for e, f in zip(errs, fla_errs)), (errs, fla_errs)


def test_triton_l2norm_and_fused_gate():
    B, T, H, K, V = 2, 200, 2, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    args = [r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16(), r(B, T, H, V).bfloat16(), r(B, T, H), r(B, T, H)]
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=r(H), dt_bias=r(H),
              use_beta_sigmoid_in_kernel=True, output_final_state=True)
    do, dht = torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")
    f = rewy_hf.chunk_gated_delta_rule
    ref = _grads(lambda *a, **k: f(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: f(*a, backend="triton", **k), args, kw, do, dht)
    errs = [_rel(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs


@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_triton_packed_sequences(op, policy):
    """cu_seqlens (three sequences packed in one row, an initial state each) against the
    torch backend in float32, and each sequence against its own unpacked run."""
    lengths = [200, 64, 333]
    T, H, K, V = sum(lengths), 2, 128, 64
    args, kw = _inputs(op, 1, T, H, H, K, V, h0=False, seed=2)
    kw["initial_state"] = 0.3 * torch.randn(len(lengths), H, K, V, device="cuda")
    kw["cu_seqlens"] = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(1, T, H, V, device="cuda")
    dht = torch.randn(len(lengths), H, K, V, device="cuda")
    ref = _grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    errs = [_rel(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs
