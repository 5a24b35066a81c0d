"""rewy's reverse state walk (scalar_gate/reverse_walk.py), under TRITON_INTERPRET=1.

The walk fed the prestage's local dv must give the dh, dh0 and dv2 of FLA's reverse recurrence
fed the same (written out as the torch loop of state_loops.py), in float32. Outputs are NaN-filled
first, so a tile the walk skips cannot pass. Then its refusals, the rule that picks it, and the
Function with the walk in place of FLA's reverse recurrence.
"""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.triton_backend.scalar_gate import reverse_walk as walk
from rewy_hf.kernels.triton_backend.scalar_gate import stages
from rewy_hf.kernels.triton_backend.scalar_gate.prestage import recompute_wu_and_dv_local
from rewy_hf.kernels.triton_backend.scalar_gate.reverse_walk import reverse_walk
from rewy_hf.rel_error import rel_err
from state_loops import loop_bwd_dhu, loop_fwd_h, replace_recurrences
from walk_cases import CASES, named_case, nan_filled, walk_case


@pytest.mark.parametrize("name", list(CASES))
def test_walk_matches_the_reverse_recurrence(name, monkeypatch):
    """dh, dh0, dv2 against the reverse recurrence fed the same local dv: K in one or two 64-row
    halves (masked below 64 and between), GVA, rows (B > 1), ragged and packed sequences (one
    empty), with and without h0 / dht, DeltaNet (no gate)."""
    x, do, h0, dht, _, cu = named_case(name, seed=2)
    w, _, dv = recompute_wu_and_dv_local(**x, do=do)
    want = loop_bwd_dhu(q=x["q"], k=x["k"], w=w, do=do, dv=dv, g=x["g"], h0=h0, dht=dht, scale=x["scale"],
                        cu_seqlens=cu)
    nan_filled(monkeypatch)
    got = reverse_walk(x["q"], x["k"], w, do, dv, g=x["g"], h0=h0, dht=dht, scale=x["scale"], cu_seqlens=cu)
    errors = {n: rel_err(a, b) for n, a, b in zip(("dh", "dh0", "dv2"), got, want) if a is not None}
    assert (got[1] is None) == (h0 is None)
    assert len(errors) == 2 + (h0 is not None) and max(errors.values()) < 2e-6, errors


def test_walk_refuses_wide_keys_and_rows_with_packing():
    x, do, _, _ = walk_case(True, 1, 64, 1, 1, 64, 16, seed=3)
    w, _, dv = recompute_wu_and_dv_local(**x, do=do)
    wide = torch.zeros(1, 64, 1, 192)
    with pytest.raises(ValueError, match="the reverse walk takes key head dims up to 128"):
        reverse_walk(wide, wide, wide, do, dv, g=x["g"])
    with pytest.raises(ValueError, match="need B = 1"):
        reverse_walk(x["q"].expand(2, -1, -1, -1), x["k"], w, do, dv, cu_seqlens=torch.tensor([0, 32, 64]))


@pytest.mark.parametrize("K, want", [(16, True), (64, True), (100, True), (128, True), (192, False), (256, False)])
def test_the_walk_takes_keys_up_to_two_halves(K, want):
    """Any shape with K up to 128 (the walk's two 64-row halves), FLA's bwd_dhu above; read from the
    shape alone (a meta tensor)."""
    assert walk.takes(torch.empty(1, 64, 2, K, device="meta")) is want


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
def test_function_with_the_walk(op, packed, monkeypatch):
    """Policy recompute: the walk runs, fed the prestage's local dv; the GDN / DeltaNet Function's
    gradients against the torch backend's, with FLA's reverse recurrence and its local dv stage
    made to fail."""
    from test_scalar_gate_function import _compare, _inputs

    def refuse(*_, **__):
        raise AssertionError("FLA's reverse recurrence or its local dv stage ran where the walk serves")

    ran = []
    walk_fn = walk.reverse_walk
    replace_recurrences(monkeypatch, loop_fwd_h, refuse)
    monkeypatch.setattr(stages.fla_stages, "dv_local", refuse)
    monkeypatch.setattr(walk, "reverse_walk", lambda *a, **kw: ran.append("walk") or walk_fn(*a, **kw))
    cu = torch.tensor([0, 70, 200, 230]) if packed else None
    inputs, do, dht = _inputs(op, T=230, H=1 if op == "gdn" else 2, HV=2, K=32, V=16, N=3 if packed else 1,
                              seed=19)
    _compare(op, inputs, do, dht, "recompute", cu_seqlens=cu)
    assert ran == ["walk"]
