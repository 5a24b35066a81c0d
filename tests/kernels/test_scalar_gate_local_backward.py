"""The ReWY Triton kernel for GDN / DeltaNet, under TRITON_INTERPRET=1 on CPU.

It is fed the torch backend's own intermediates (A, W, U, the chunk states and
their gradients, Vn and dVn), moved to FLA's layout, and must reproduce the
torch backend's local gradients (dq, dk, dv, dg, dbeta) to float32 accuracy.
bfloat16 is not used: the interpreter's tl.dot is wrong for it.
"""

from __future__ import annotations

import math

import pytest
import torch

from rewy_hf.kernels.constants import CHUNK as C
from rewy_hf.kernels.triton_backend.scalar_gate.local_backward import rewy_gdn_bwd_local
from rewy_hf.rel_error import rel_err
from scalar_gate_stages import as_float32, kernel_inputs, stages, to_fla


def _nan_filled_buffers(monkeypatch):
    """Every buffer the wrapper allocates from here on starts as NaN, so an output tile or a key
    block's gradient share the kernel leaves unwritten cannot pass as zeros."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))


# K = 128 and 96 split into key blocks of 64 (the second one partly masked).
@pytest.mark.parametrize("kind,T,K,V", [("gdn", 2 * C, 16, 32), ("gdn", 150, 16, 128), ("gdn", 100, 16, 256),
                                        ("delta_rule", 150, 16, 32), ("gdn", 100, 128, 32), ("gdn", 70, 96, 64),
                                        ("delta_rule", 70, 128, 16)])
def test_kernel_matches_torch_stage(kind, T, K, V, monkeypatch):
    N, H, HV = 2, 1, 2
    NT = math.ceil(T / C)
    # the stages and their gradients in float64 (the ground truth), the kernel fed their float32 copies
    x, gt, s, do, dVn, dHnext, ref = stages(kind, N, H, HV, NT, K, V, T, seed=T + V, dtype=torch.float64)
    fla = lambda t: to_fla(t, T)
    _nan_filled_buffers(monkeypatch)
    dq, dk, dv, dg, db = rewy_gdn_bwd_local(**as_float32(kernel_inputs(kind, x, gt, s, do, dVn, dHnext, T, H, HV)),
                                            scale=x.scale)
    rq, rk, rv, rg, rb, _ = ref
    errors = {"dq": rel_err(dq, fla(rq)), "dk": rel_err(dk, fla(rk)), "dv": rel_err(dv, fla(rv)),
              "db": rel_err(db, fla(rb)[..., 0])}
    if kind == "gdn":
        errors["dg"] = rel_err(dg, fla(rg)[..., 0])
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("kind", ["gdn", "delta_rule"])
def test_kernel_packed_sequences(kind, monkeypatch):
    """cu_seqlens: three sequences packed into one row (B = 1), chunks and states in FLA's
    global chunk order, must give each sequence exactly its own gradients."""
    H, HV, K, V = 1, 2, 96, 32
    lengths = [70, 130, 20]
    parts, refs = [], []
    for i, T in enumerate(lengths):
        x, gt, s, do, dVn, dHnext, ref = stages(kind, 1, H, HV, math.ceil(T / C), K, V, T, seed=50 + i,
                                                   dtype=torch.float64)
        parts.append(as_float32(kernel_inputs(kind, x, gt, s, do, dVn, dHnext, T, H, HV)))
        refs.append([to_fla(r, T) for r in ref[:5]])
    packed = {name: (None if parts[0][name] is None else
                     torch.cat([p[name] for p in parts], dim=1)) for name in parts[0] if name not in ("h", "dh")}
    packed["h"] = torch.cat([p["h"] for p in parts], dim=1)
    packed["dh"] = torch.cat([p["dh"] for p in parts], dim=1)
    cu = torch.tensor([0] + lengths).cumsum(0)
    chunk_indices = torch.tensor([[n, t] for n, T in enumerate(lengths) for t in range(math.ceil(T / C))])
    _nan_filled_buffers(monkeypatch)
    dq, dk, dv, dg, db = rewy_gdn_bwd_local(**packed, scale=K ** -0.5, cu_seqlens=cu, chunk_indices=chunk_indices)
    rq, rk, rv, rg, rb = (torch.cat([r[i] for r in refs], dim=1) for i in range(5))
    errors = {"dq": rel_err(dq, rq), "dk": rel_err(dk, rk), "dv": rel_err(dv, rv), "db": rel_err(db, rb[..., 0])}
    if kind == "gdn":
        errors["dg"] = rel_err(dg, rg[..., 0])
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("log_gate", [-10.0, -20.0])
def test_gate_gradient_under_strong_decay(log_gate, monkeypatch):
    """A log-gate near -10 (or -20) per token spans e^-640 (e^-1280) in one chunk. The stages are
    formed in float64 and the kernel, fed their float32 copies, must keep q, k, v and beta's
    gradients to float32 accuracy and the gate's to the float32 cumulative gate's own rounding
    (about 2e-5 at -20). The gate's terms are e^-10 apart, so a gate gradient formed as the
    difference of large terms (the output Gram's diagonal entering and leaving, or the last key's
    decay added and taken away) loses them to rounding: so formed, dg was 3.5e-2 off at -10 and
    8e2 at -20."""
    T, K, V, N, H, HV = 2 * C, 64, 32, 1, 1, 2
    x, gt, s, do, dVn, dHnext, ref = stages("gdn", N, H, HV, 2, K, V, T, seed=11, log_gate=log_gate,
                                               dtype=torch.float64)
    inputs = as_float32(kernel_inputs("gdn", x, gt, s, do, dVn, dHnext, T, H, HV))
    _nan_filled_buffers(monkeypatch)
    out = rewy_gdn_bwd_local(**inputs, scale=x.scale)
    errors = {}
    for name, o, r in zip(("dq", "dk", "dv", "dg", "db"), out, [to_fla(t, T) for t in ref[:5]]):
        errors[name] = rel_err(o, r[..., 0] if o.dim() == 3 else r)
    assert errors["dg"] < 1e-4 and max(v for n, v in errors.items() if n != "dg") < 1e-6, errors


def test_kernel_with_one_key_block_of_128(monkeypatch):
    """block_k=128: one program per chunk covers K (the wrapper's other allowed width); stages in
    float64, the kernel fed their float32 copies."""
    T, K, V, N, H, HV = 100, 128, 32, 1, 1, 1
    x, gt, s, do, dVn, dHnext, ref = stages("gdn", N, H, HV, math.ceil(T / C), K, V, T, seed=7,
                                               dtype=torch.float64)
    inputs = as_float32(kernel_inputs("gdn", x, gt, s, do, dVn, dHnext, T, H, HV))
    _nan_filled_buffers(monkeypatch)
    out = rewy_gdn_bwd_local(**inputs, scale=x.scale, block_k=128)
    for o, r in zip(out, [to_fla(t, T) for t in ref[:5]]):
        r = r[..., 0] if o.dim() == 3 else r
        assert rel_err(o, r) < 1e-5


def test_narrow_key_blocks_are_refused():
    """Key blocks under 64 channels changed with the launch config on the H200 (triton 3.6.0):
    the wrapper refuses them with the fix, instead of running them."""
    T, K, V = 64, 32, 32
    x, gt, s, do, dVn, dHnext, _ = stages("gdn", 1, 1, 1, 1, K, V, T, seed=3)
    with pytest.raises(ValueError, match="narrower than 64.*use 64"):
        rewy_gdn_bwd_local(**kernel_inputs("gdn", x, gt, s, do, dVn, dHnext, T, 1, 1), scale=x.scale, block_k=32)
