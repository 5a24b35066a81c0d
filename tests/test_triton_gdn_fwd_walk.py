"""rewy's rebuild of h that forms u itself (REWY_HF_GDN_FWD_WALK), under TRITON_INTERPRET=1.

The walk fed A, beta and V must give the h and v_new of FLA's forward
recurrence fed u = A diag(beta) V (the prestage's u; the recurrence written
out as the torch loop of state_loops.py), in float32; and the GDN / DeltaNet
Function with it (alone, with the reverse walk, and from state checkpoints)
must give the torch backend's gradients. Outputs are NaN-filled first, so a
tile the kernel skips cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels import triton_gdn, triton_gdn_fwd_walk
from rewy_hf.kernels.triton_gdn_fwd_walk import rebuild_states
from rewy_hf.kernels.triton_gdn_prestage import recompute_wu_and_scores
from rewy_hf.rel_error import rel_err
from state_loops import loop_bwd_dhu, loop_fwd_h, replace_recurrences
from walk_cases import CASES, named_case, nan_filled, walk_case


@pytest.mark.parametrize("name", list(CASES))
def test_prestage_without_u_writes_the_same_w_and_scores(name, monkeypatch):
    x, *_ = named_case(name, seed=4)
    nan_filled(monkeypatch)
    w, u, st = recompute_wu_and_scores(**x)
    w2, u2, st2 = recompute_wu_and_scores(**x, with_u=False)
    assert u2 is None and torch.equal(w, w2) and torch.equal(st, st2) and not u.isnan().any()


@pytest.mark.parametrize("name", list(CASES))
def test_walk_matches_the_forward_recurrence(name, monkeypatch):
    """h and v_new against the forward recurrence fed the prestage's u: K in one or two 64-row
    halves (masked below 64 and between), GVA, rows (B > 1), ragged and packed sequences (one
    empty), with and without an initial state, DeltaNet (no gate)."""
    x, _, h0, _, _, cu = named_case(name, seed=5)
    w, u, _ = recompute_wu_and_scores(**x)
    want = loop_fwd_h(k=x["k"], w=w, u=u, g=x["g"], initial_state=h0, cu_seqlens=cu)[:2]
    nan_filled(monkeypatch)
    got = rebuild_states(x["k"], w, x["v"], x["beta"], x["A"], g=x["g"], initial_state=h0, cu_seqlens=cu)
    errors = {n: rel_err(a, b) for n, a, b in zip(("h", "v_new"), got, want)}
    assert max(errors.values()) < 2e-6, errors


def test_walk_refuses_wide_keys_and_rows_with_packing():
    x, _, _, _ = walk_case(True, 1, 64, 1, 1, 64, 16, seed=6)
    wide = torch.zeros(1, 64, 1, 192)
    with pytest.raises(ValueError, match="up to 128.*REWY_HF_GDN_FWD_WALK=0"):
        rebuild_states(wide, wide, x["v"], x["beta"], x["A"])
    two = x["k"].expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="need B = 1"):
        rebuild_states(two, two, x["v"], x["beta"], x["A"], cu_seqlens=torch.tensor([0, 32, 64]))


@pytest.mark.parametrize("setting", ["alone", "with the reverse walk", "from checkpoints"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
def test_function_with_the_walk(op, packed, setting, monkeypatch):
    """REWY_HF_GDN_FWD_WALK=1, policy recompute: the Function's gradients against the torch
    backend's; FLA's forward recurrence runs once (the forward's own), never in the backward."""
    from test_triton_gdn_function import _compare, _inputs

    calls = []

    def fwd_h(**kw):
        calls.append(kw["u"].shape)
        return loop_fwd_h(**kw)

    replace_recurrences(monkeypatch, fwd_h, loop_bwd_dhu)
    monkeypatch.setenv(triton_gdn_fwd_walk.FWD_WALK_ENV, "1")
    monkeypatch.setenv("REWY_HF_GDN_WALK", "1" if setting == "with the reverse walk" else "0")
    monkeypatch.setenv("REWY_HF_STATE_CHECKPOINTS", "2" if setting == "from checkpoints" else "off")
    cu = torch.tensor([0, 70, 200, 230]) if packed else None
    inputs, do, dht = _inputs(op, T=230, H=1 if op == "gdn" else 2, HV=2, K=32, V=16, N=3 if packed else 1,
                              seed=20)
    segmented = []
    rebuild = triton_gdn.state_checkpoints.rebuild
    monkeypatch.setattr(triton_gdn.state_checkpoints, "rebuild",
                        lambda *a, **kw: segmented.append(kw["walk"]) or rebuild(*a, **kw))
    _compare(op, inputs, do, dht, "recompute", cu_seqlens=cu)
    assert len(calls) == 1, calls
    assert segmented == ([triton_gdn_fwd_walk.rebuild_states] if setting == "from checkpoints" else [])
