"""rewy's reverse state recurrence with the local dv folded in (kernels/triton_dhu_local.py) under
TRITON_INTERPRET=1, against the torch backend's state gradients computed in float64.

The kernel gets what FLA's bwd_dhu gets, minus its dv input: for GDN and DeltaNet the raw q and k
(it rebuilds A from them and the gate), for KDA the gated q and k and the saved A_qk. Outputs
written with torch.empty are first filled with NaN, so a tile the kernel skips cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from state_cases import state_case

from rewy_hf.kernels import triton_dhu_local as D


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(autouse=True)
def _nan_empty(monkeypatch):
    real = torch.empty_like, torch.Tensor.new_empty
    nan = lambda t: t.fill_(float("nan")) if t.is_floating_point() else t      # noqa: E731
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(real[0](*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: nan(real[1](self, *a, **k)))


def _run(kind, N, H, HV, K, V, T, with_h0, v_first=False, packed=False, seed=0):
    x64, ref = state_case(kind, N, H, HV, K, V, T, seed=seed, with_h0=with_h0, dtype=torch.float64)
    x = {n: t.float() if isinstance(t, torch.Tensor) else t for n, t in x64.items()}
    cu = None
    if packed:
        # The N sequences of length T laid end to end in one row: the kernel must find each one's chunks.
        x = {n: (t.reshape(1, N * T, *t.shape[2:]) if n in ("q", "k", "w", "do", "g", "gk", "A") and t is not None
                 else t) for n, t in x.items()}
        cu = torch.arange(N + 1, dtype=torch.int32) * T
    h0, dht = x["h0"], x["dht"]
    if v_first and with_h0:
        h0, dht = h0.transpose(-1, -2).contiguous(), dht.transpose(-1, -2).contiguous()
    dh, dh0, dv2 = D.rewy_dhu_local(x["q"], x["k"], x["w"], x["do"], g=x["g"], gk=x["gk"],
                                    A=x["A"] if kind == "kda" else None, h0=h0, dht=dht, scale=x["scale"],
                                    state_v_first=v_first, cu_seqlens=cu)
    if v_first:
        dh = dh.transpose(-1, -2)
        dh0 = None if dh0 is None else dh0.transpose(-1, -2)
    ref_dh, ref_dv2 = ref["dh"], ref["dv2"]
    if packed:
        ref_dh = ref_dh.reshape(1, -1, *ref_dh.shape[2:])
        ref_dv2 = ref_dv2.reshape(1, N * T, *ref_dv2.shape[2:])
    errors = {"dh": _rel(dh, ref_dh), "dv2": _rel(dv2, ref_dv2)}
    if with_h0:
        errors["dh0"] = _rel(dh0, ref["dh0"])
    return errors


@pytest.mark.parametrize("kind,H,HV,K,V,T,with_h0", [
    ("gdn", 1, 2, 32, 16, 600, True),        # ragged last chunk (600 = 9 x 64 + 24)
    ("gdn", 1, 2, 64, 32, 256, False),
    ("gdn", 1, 4, 48, 40, 200, True),        # GVA (two value heads per key head), K and V not powers of two
    ("delta_rule", 1, 2, 32, 48, 450, True),
    ("kda", 2, 2, 32, 16, 600, True),
    ("kda", 1, 1, 64, 32, 300, False),
])
def test_matches_the_torch_backend(kind, H, HV, K, V, T, with_h0):
    errors = _run(kind, 2, H, HV, K, V, T, with_h0)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_packed_sequences_and_the_v_first_state(kind):
    assert max(_run(kind, 3, 1, 2, 32, 16, 200, True, packed=True).values()) < 1e-5
    assert max(_run(kind, 2, 1, 2, 32, 16, 200, True, v_first=True).values()) < 1e-5


@pytest.mark.parametrize("BV", [16, 32, 64])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_each_column_block_width(kind, BV):
    """K = V = 128 with each width the autotuner may pick (the interpreter otherwise runs only the first)."""
    import triton

    from rewy_hf.cpu_triton import only_config

    with only_config(D.rewy_dhu_local_kernel, triton.Config({"BV": BV}, num_warps=4, num_stages=2)):
        errors = _run(kind, 1, 1, 1, 128, 128, 192, True, seed=BV)
    assert max(errors.values()) < 1e-5, errors


def test_the_width_rule_and_the_limits():
    """BV 16 only where state_launch's rule narrows; wide keys and KDA without A are refused with the fix."""
    cfgs = D.rewy_dhu_local_kernel.configs if not hasattr(D.rewy_dhu_local_kernel, "listed_configs") \
        else D.rewy_dhu_local_kernel.listed_configs
    narrow = D._prune_widths(cfgs, {"NARROW": True})
    wide = D._prune_widths(cfgs, {"NARROW": False})
    assert {c.kwargs["BV"] for c in narrow} == {16} and {c.kwargs["BV"] for c in wide} == {32, 64}
    assert D.supported(128, 1) and not D.supported(256, 1) and not D.supported(64, 3)
    q = torch.zeros(1, 64, 1, 256)
    with pytest.raises(ValueError, match="key head dims up to 128, got 256"):
        D.rewy_dhu_local(q, q, q, torch.zeros(1, 64, 1, 16))
    q = torch.zeros(1, 64, 1, 32)
    with pytest.raises(ValueError, match="need the saved A_qk: pass A"):
        D.rewy_dhu_local(q, q, q, torch.zeros(1, 64, 1, 16), gk=q)
