"""The split reverse pass (kernels/triton_backend/split_reverse.py) on the CPU.

Its outputs must be the whole sequences' reverse pass: first with FLA's reverse recurrence written
as a torch loop (tests/support/state_loops.py) as the family's walk, in float32, for both gate
kinds and both state layouts, rows and packed sequences (one empty), with and without dht / h0;
then with rewy's Triton walk under TRITON_INTERPRET=1. Then the rule that picks it, and the
Function of each family with the split in place of the sequential walk.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rewy_hf.kernels.triton_backend import segments as S
from rewy_hf.kernels.triton_backend import split_reverse as split
from rewy_hf.rel_error import rel_err
from state_loops import loop_bwd_dhu


def _case(gate, B, T, H, HV, K, V, cu, seed, states=(True, True), v_first=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    N = B if cu is None else len(cu) - 1
    inputs = dict(q=r(B, T, H, K), k=F.normalize(r(B, T, H, K), dim=-1), w=0.3 * F.normalize(r(B, T, HV, K), dim=-1))
    # chunk-local cumulative log2 gates: only their differences inside a chunk and their value at the chunk's
    # end enter, so any values <= 0 that fall along the chunk do
    if gate == "g":
        inputs["g"] = -torch.rand(B, T, HV, generator=gen).cumsum(1) * 0.05
    elif gate == "gk":
        inputs["gk"] = -torch.rand(B, T, HV, K, generator=gen).cumsum(1) * 0.05
    state = (N, HV, V, K) if v_first else (N, HV, K, V)
    dht = r(*state) if states[0] else None
    h0 = r(*state) if states[1] else None
    return inputs, r(B, T, HV, V), r(B, T, HV, V), dht, h0


def _loop_walk(scale):
    calls = []

    def walk(**kw):
        calls.append(kw)
        return loop_bwd_dhu(**kw, scale=scale)
    return walk, calls


CASES = {
    # gate, B, T, H, HV, K, V, cu_seqlens, L, (dht, h0), V-first
    "scalar_rows": ("g", 2, 300, 1, 2, 16, 8, None, 2, (True, True), False),
    "scalar_one_chunk_segments": ("g", 1, 200, 2, 2, 8, 12, None, 1, (True, True), False),
    "no_gate_no_dht": (None, 2, 257, 2, 2, 16, 8, None, 2, (False, True), False),
    "key_gate_v_first": ("gk", 1, 330, 1, 1, 16, 8, None, 2, (True, True), True),
    "key_gate_packed_with_empty": ("gk", 1, 460, 2, 2, 8, 16, [0, 130, 130, 400, 460], 2, (True, True), False),
    "scalar_packed_no_h0": ("g", 1, 700, 1, 2, 16, 8, [0, 5, 640, 700], 3, (True, False), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_split_pass_is_the_whole_sequences_pass(name):
    gate, B, T, H, HV, K, V, cu, L, states, v_first = CASES[name]
    cu = None if cu is None else torch.tensor(cu)
    inputs, do, dv, dht, h0 = _case(gate, B, T, H, HV, K, V, cu, seed=4, states=states, v_first=v_first)
    scale = K ** -0.5
    want = loop_bwd_dhu(**inputs, do=do, dv=dv, h0=h0, dht=dht, scale=scale, state_v_first=v_first, cu_seqlens=cu)
    bounds = S.row_bounds(B, T) if cu is None else tuple(cu.tolist())
    seg = S.cut(bounds, L, torch.device("cpu"))
    assert seg.cuts
    walk, calls = _loop_walk(scale)
    got = split.reverse(walk, seg, inputs, do, dv, dht, h0, state_v_first=v_first)
    # two walks over the segments: the wide one (K-first), then the exact one in the call's layout
    assert [c["do"].shape[-1] for c in calls] == [V + K, V]
    assert [c["state_v_first"] for c in calls] == [False, v_first]
    assert all(c["cu_seqlens"] is seg.cu_seqlens for c in calls)
    assert (got[1] is None) == (h0 is None)
    errors = {n: rel_err(a, b) for n, a, b in zip(("dh", "dh0", "dv2"), got, want) if a is not None}
    assert got[0].shape == want[0].shape and got[2].shape == want[2].shape
    assert max(errors.values()) < 1e-5, errors


def test_end_gradients_follow_each_sequence_from_its_last_segment():
    """Step 2 alone: sequences of 3, 1 and 2 segments, E by hand."""
    seg = S.cut((0, 192, 256, 384), 1, torch.device("cpu"))
    assert seg.per_sequence == (3, 1, 2)
    gen = torch.Generator().manual_seed(1)
    P, T, dht = torch.randn(6, 1, 3, 2, generator=gen), torch.randn(6, 1, 3, 3, generator=gen), torch.randn(3, 1, 3, 2)
    E = split.end_gradients(torch.cat([P, T], dim=-1), 2, seg, dht)
    want = torch.empty_like(E)
    want[2], want[3], want[5] = dht[0], dht[1], dht[2]
    want[1] = P[2] + T[2] @ want[2]
    want[0] = P[1] + T[1] @ want[1]
    want[4] = P[5] + T[5] @ want[5]
    assert rel_err(E, want) < 1e-6


@pytest.mark.parametrize("packed", [False, True])
def test_split_pass_with_rewys_walk(packed, monkeypatch):
    """rewy's Triton walk (GDN) as the family's walk, split into one- and two-chunk segments, against
    the whole sequences' walk and the torch loop, float32 under the interpreter."""
    from nan_fill import nan_filled
    from rewy_hf.kernels.triton_backend.scalar_gate.reverse_walk import reverse_walk

    B, T, cu = (1, 300, torch.tensor([0, 70, 300])) if packed else (2, 200, None)
    inputs, do, dv, dht, h0 = _case("g", B, T, 1, 2, 32, 16, cu, seed=8)
    scale = 32 ** -0.5
    whole = reverse_walk(**inputs, do=do, dv=dv, h0=h0, dht=dht, scale=scale, cu_seqlens=cu)
    nan_filled(monkeypatch)

    def walk(state_v_first, **kw):
        assert not state_v_first
        return reverse_walk(**kw, scale=scale)

    bounds = S.row_bounds(B, T) if cu is None else tuple(cu.tolist())
    for L in (1, 2):
        got = split.reverse(walk, S.cut(bounds, L, torch.device("cpu")), inputs, do, dv, dht, h0)
        errors = [rel_err(a, b) for a, b in zip(got, whole)]
        assert max(errors) < 1e-5, (L, errors)


def test_the_rule_splits_only_where_the_narrow_walk_leaves_most_sms_idle():
    sms = 132
    for N, HV, NT in [(1, 1, 512), (1, 2, 512), (1, 4, 1024), (2, 2, 512)]:
        L = split.chunks_per_segment([NT] * N, HV, 128, sms)
        assert L is not None and split.MIN_CHUNKS <= L < NT, (N, HV, L)
        programs = N * HV * 8 * -(-NT // L)
        assert L == split.MIN_CHUNKS or programs >= 0.9 * split.PROGRAMS_PER_SM * sms, (N, HV, L)
    for N, HV in [(1, 8), (1, 16), (1, 32), (4, 16), (8, 16)]:
        assert split.chunks_per_segment([512] * N, HV, 128, sms) is None, (N, HV)
    # decided from the shapes where they suffice; a short sequence is not cut
    assert split.plan(torch.empty(1, 32768, 16, 128), None) is None
    assert split.plan(torch.empty(1, 64 * split.MIN_CHUNKS, 1, 128), None) is None
    seg = split.plan(torch.empty(1, 32768, 1, 128), None)
    assert seg is not None and seg.cuts and seg.length >= split.MIN_CHUNKS
