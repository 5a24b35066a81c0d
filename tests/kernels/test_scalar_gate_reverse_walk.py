"""rewy's reverse walk with the local value gradient inside (scalar_gate/reverse_walk.py), under
TRITON_INTERPRET=1.

Two parts: the prestage's S^T output, whose product with dO per chunk must be
the local value gradient its dv output gives; and the walk fed that S^T,
whose dh, dh0 and dv2 must be those of FLA's reverse recurrence fed the local
dv (written out as the torch loop of state_loops.py), in float32. Outputs are
NaN-filled first, so a tile the kernels skip cannot pass. Then the rule that picks the walk, and
the Function with the walk in place of FLA's reverse recurrence.
"""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.triton_backend.scalar_gate import reverse_walk as walk
from rewy_hf.kernels.triton_backend.scalar_gate import stages
from rewy_hf.kernels.triton_backend.scalar_gate.prestage import recompute_wu_and_dv_local, recompute_wu_and_scores
from rewy_hf.kernels.triton_backend.scalar_gate.reverse_walk import reverse_walk
from rewy_hf.rel_error import rel_err
from state_loops import loop_bwd_dhu, loop_fwd_h, replace_recurrences
from walk_cases import CASES, C, named_case, nan_filled, walk_case


@pytest.mark.parametrize("name", list(CASES))
def test_scores_give_the_local_dv(name, monkeypatch):
    x, do, _, _, (B, T, HV, V), cu = named_case(name, seed=1)
    nan_filled(monkeypatch)
    w, u, dv = recompute_wu_and_dv_local(**x, do=do)
    w2, u2, st = recompute_wu_and_scores(**x)
    assert st.shape == (B, T, HV, C) and torch.equal(w, w2) and torch.equal(u, u2)
    dv_from_st = torch.zeros_like(dv)
    bounds = [0, T] if cu is None else cu.tolist()
    for b, e in zip(bounds[:-1], bounds[1:]):
        for s in range(b, e, C):
            n = min(s + C, e) - s
            dv_from_st[:, s:s + n] = torch.einsum("bjhi,bihv->bjhv", st[:, s:s + n, :, :n], do[:, s:s + n])
    assert rel_err(dv_from_st, dv) < 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_walk_matches_the_reverse_recurrence(name, monkeypatch):
    """dh, dh0, dv2 against the reverse recurrence fed the local dv: K in one or two 64-row
    halves (masked below 64 and between), GVA, rows (B > 1), ragged and packed sequences (one
    empty), with and without h0 / dht, DeltaNet (no gate)."""
    x, do, h0, dht, _, cu = named_case(name, seed=2)
    w, _, dv = recompute_wu_and_dv_local(**x, do=do)
    _, _, st = recompute_wu_and_scores(**x)
    want = loop_bwd_dhu(q=x["q"], k=x["k"], w=w, do=do, dv=dv, g=x["g"], h0=h0, dht=dht, scale=x["scale"],
                        cu_seqlens=cu)
    nan_filled(monkeypatch)
    got = reverse_walk(x["q"], x["k"], w, st, do, g=x["g"], h0=h0, dht=dht, scale=x["scale"], cu_seqlens=cu)
    errors = {n: rel_err(a, b) for n, a, b in zip(("dh", "dh0", "dv2"), got, want) if a is not None}
    assert (got[1] is None) == (h0 is None)
    assert len(errors) == 2 + (h0 is not None) and max(errors.values()) < 2e-6, errors


def test_walk_refuses_wide_keys_and_rows_with_packing():
    x, do, _, _ = walk_case(True, 1, 64, 1, 1, 64, 16, seed=3)
    w, _, st = recompute_wu_and_scores(**x)
    wide = torch.zeros(1, 64, 1, 192)
    with pytest.raises(ValueError, match="the reverse walk takes key head dims up to 128"):
        reverse_walk(wide, wide, wide, st, do, g=x["g"])
    with pytest.raises(ValueError, match="need B = 1"):
        reverse_walk(x["q"].expand(2, -1, -1, -1), x["k"], w, st, do, cu_seqlens=torch.tensor([0, 32, 64]))


def _shaped(B, T, HV, K=128, V=128):
    """k and v of these shapes, as meta tensors: chosen() reads shapes only."""
    return torch.empty(B, T, 1, K, device="meta"), torch.empty(B, T, HV, V, device="meta")


@pytest.mark.parametrize("B, HV, K, sequences, want", [
    (8, 16, 128, None, True),       # 256 programs at V / 64 = 2 per head: the GPU is full
    (4, 16, 128, None, True),       # 128 on 132 SMs: half or more
    (2, 16, 128, None, False),      # 64: the chain is the critical path
    (1, 16, 128, None, False),
    (1, 32, 128, None, False),
    (8, 16, 256, None, False),      # wider keys than the walk's two halves: FLA's bwd_dhu
    (1, 16, 128, 5, True),          # packed: the sequences count, not B
    (1, 16, 128, 2, False),
])
def test_the_walk_is_chosen_where_the_gpu_is_full(B, HV, K, sequences, want):
    """The walk where N x HV x V / 64 programs fill half the 132 SMs (the CPU stands in for an
    H200), FLA's bwd_dhu elsewhere."""
    k, v = _shaped(B, 64, HV, K)
    cu = None if sequences is None else torch.arange(sequences + 1) * 64 // sequences
    assert walk.chosen(k, v, cu) is want


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
def test_function_with_the_walk(op, packed, monkeypatch):
    """Policy recompute on a GPU the shapes fill (few SMs): the walk is chosen, fed the prestage's
    scores; the GDN / DeltaNet Function's gradients against the torch backend's, with FLA's reverse
    recurrence and both local dv forms made to fail."""
    from test_scalar_gate_function import _compare, _inputs, few_sms

    def refuse(*_, **__):
        raise AssertionError("FLA's reverse recurrence or a local dv stage ran where the walk was chosen")

    ran = []
    walk_fn, scores_fn = walk.reverse_walk, stages.prestage.recompute_wu_and_scores
    replace_recurrences(monkeypatch, loop_fwd_h, refuse)
    few_sms(monkeypatch)
    monkeypatch.setattr(stages.prestage, "recompute_wu_and_dv_local", refuse)
    monkeypatch.setattr(stages.fla_stages, "dv_local", refuse)
    monkeypatch.setattr(walk, "reverse_walk", lambda *a, **kw: ran.append("walk") or walk_fn(*a, **kw))
    monkeypatch.setattr(stages.prestage, "recompute_wu_and_scores",
                        lambda *a, **kw: ran.append("scores") or scores_fn(*a, **kw))
    cu = torch.tensor([0, 70, 200, 230]) if packed else None
    inputs, do, dht = _inputs(op, T=230, H=1 if op == "gdn" else 2, HV=2, K=32, V=16, N=3 if packed else 1,
                              seed=19)
    _compare(op, inputs, do, dht, "recompute", cu_seqlens=cu)
    assert ran == ["scores", "walk"]
