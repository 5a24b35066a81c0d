"""State checkpoints (kernels/triton_backend/state_checkpoints.py): the recompute policy's states
rebuilt segment by segment from the forward's h. The segment tables are checked against FLA's own
table builders, the rebuild against the whole-sequence recurrence (FLA's fwd_h as a torch loop,
tests/support/state_loops.py), and the triton-backend Function with checkpoints against the torch
backend under TRITON_INTERPRET=1. Segment lengths other than the rule's come from replacing
``chunks_per_segment``, the rule's one answer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.kernels.triton_backend import state_checkpoints as C
from rewy_hf.kernels.triton_backend import state_launch
from rewy_hf.kernels import triton_entry
from rewy_hf.rel_error import rel_err
from state_loops import loop_bwd_dhu, loop_fwd_h, replace_recurrences


def _bounds(B, T, cu):
    return list(range(0, B * T + 1, T)) if cu is None else cu.tolist()


def _segment_length(monkeypatch, L):
    """Every call's sequences cut into segments of L chunks (the shortest segment, which bounds
    how many a packed call keeps)."""
    monkeypatch.setattr(C, "chunks_per_segment", lambda *_: L)
    monkeypatch.setattr(C, "MIN_CHUNKS", min(L, C.MIN_CHUNKS))


@pytest.mark.parametrize("B,T,cu,L", [(1, 300, None, 2), (3, 200, None, 1), (1, 230, [0, 70, 200, 230], 2),
                                      (1, 700, [0, 5, 640, 700], 3), (1, 200, [0, 0, 70, 70, 200, 200], 1)])
def test_segments_cut_every_sequence_on_its_chunk_bounds(B, T, cu, L, monkeypatch):
    from fla.ops.utils import prepare_chunk_indices, prepare_chunk_offsets

    _segment_length(monkeypatch, L)
    cu = None if cu is None else torch.tensor(cu)
    seg = C.plan(torch.empty(B, T, 2, 16), cu)
    bounds = _bounds(B, T, cu)
    # Same chunks as the whole sequences, numbered the same way: FLA's builders on the segment
    # bounds give our table and our start chunks.
    assert torch.equal(seg.chunk_indices.long(), prepare_chunk_indices(seg.cu_seqlens.long(), 64).long())
    assert torch.equal(seg.starts, prepare_chunk_offsets(seg.cu_seqlens.long(), 64)[:-1].long())
    assert seg.count == len(seg.cu_seqlens) - 1
    assert len(seg.chunk_indices) == len(prepare_chunk_indices(torch.tensor(bounds), 64))
    cuts = seg.cu_seqlens.tolist()
    assert set(bounds) <= set(cuts) and cuts[0] == 0 and cuts[-1] == bounds[-1]
    for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        bos = max(x for x in bounds[:-1] if x <= a)
        assert (a - bos) % (64 * L) == 0 and 0 < b - a <= 64 * L, (s, a, b)
    filled = [n for n in range(len(bounds) - 1) if bounds[n + 1] > bounds[n]]     # empty sequences have no segment
    assert seg.sequences.tolist() == filled
    assert [cuts[i] for i in seg.sequence_starts.tolist()] == [bounds[n] for n in filled]


def test_rebuild_from_checkpoints_gives_the_whole_sequence_states(monkeypatch):
    """h and v_new of the segmented rebuild equal the whole-sequence recurrence's (float32,
    so each checkpoint is the exact state); rows, packed sequences and an initial state.
    The rebuild goes through rewy's launch of FLA's fwd_h, replaced here by the torch loop."""
    calls = []

    def fwd_h(**kw):
        calls.append(kw)
        return loop_fwd_h(**kw)

    monkeypatch.setattr(state_launch, "fwd_h", fwd_h)
    gen = torch.Generator().manual_seed(3)
    for B, T, cu in [(2, 300, None), (1, 460, torch.tensor([0, 130, 400, 460])),
                     (1, 460, torch.tensor([0, 0, 130, 130, 460, 460]))]:
        N = B if cu is None else len(cu) - 1
        k = F.normalize(torch.randn(B, T, 1, 16, generator=gen), dim=-1)
        w = torch.randn(B, T, 2, 16, generator=gen) * 0.2
        u = torch.randn(B, T, 2, 8, generator=gen)
        g = F.logsigmoid(torch.randn(B, T, 2, generator=gen)) * 0.1
        h0 = torch.randn(N, 2, 16, 8, generator=gen)
        h, v_new, _ = loop_fwd_h(k=k, w=w, u=u, g=g, initial_state=h0, cu_seqlens=cu)
        for L in (1, 2, 3):
            seg = C._segments(tuple(_bounds(B, T, cu)), L, torch.device("cpu"))
            states = C.save(h, h0, seg)
            assert states.shape == (seg.count, 2, 16, 8)
            assert torch.equal(states[seg.sequence_starts], h0[seg.sequences])
            h2, v_new2 = C.rebuild(states, seg, u, k=k, w=w, g=g)
            assert calls[-1]["cu_seqlens"] is seg.cu_seqlens and calls[-1]["initial_state"] is states
            assert h2.shape == h.shape and v_new2.shape == v_new.shape
            assert rel_err(h2, h) < 1e-6 and rel_err(v_new2, v_new) < 1e-6, (B, L)


def test_checkpoints_keep_h_dtype_without_initial_state():
    h = torch.randn(2, 5, 2, 16, 8).to(torch.bfloat16)
    seg = C._segments((0, 300, 600), 2, torch.device("cpu"))
    states = C.save(h, None, seg)
    assert states.dtype == torch.bfloat16 and torch.equal(states, h.flatten(0, 1)[[0, 2, 4, 5, 7, 9]])


def test_kept_fills_the_packed_bound_past_the_checkpoints_with_zeros():
    """A packed call keeps its checkpoints in a buffer of packed_count's bound; the values past them
    are an output of the custom op too, so they must be the same on every call (zeros), as an
    AOTAutograd check of the op compares them."""
    h = torch.randn(1, 10, 2, 16, 8)          # packed: B = 1, the chunk slots of both sequences
    seg = C._segments((0, 300, 600), 2, torch.device("cpu"))
    states = C.save(h, None, seg).reshape(-1)
    bound = states.numel() + 3 * 2 * 16 * 8
    out = C.kept(h, None, seg, bound)
    assert out.shape == (bound,) and torch.equal(out[:states.numel()], states)
    assert torch.count_nonzero(out[states.numel():]) == 0
    assert torch.count_nonzero(C.kept(h, None, None, 2 * 16 * 8)) == 0


def test_the_rule_cuts_only_where_the_sequential_launch_fills_under_half_the_sms():
    sms = 132
    for B, T, HV in [(2, 8192, 16), (1, 16384, 16), (1, 32768, 32), (1, 65536, 8)]:
        NT = T // 64
        assert 2 * B * HV * 2 < sms
        L = C.chunks_per_segment([NT] * B, HV, 128, sms)
        assert L is not None and C.MIN_CHUNKS <= L < NT, (B, T, HV, L)
        programs = B * -(-NT // L) * HV * 2
        assert L == C.MIN_CHUNKS or programs >= 0.9 * C.PROGRAMS_PER_SM * sms, (B, T, HV, L)
    # Half the SMs or more already busy (B x HV x V / 64 >= 66).
    for B, T, HV in [(8, 2048, 16), (4, 4096, 16), (4, 4096, 32), (1, 32768, 33)]:
        assert C.chunks_per_segment([T // 64] * B, HV, 128, sms) is None, (B, T, HV)
    # Sequences too short to cut are one segment each: nothing is cut, one checkpoint per sequence.
    seg = C.plan(torch.empty(2, C.MIN_CHUNKS * 64, 16, 128), None)
    assert seg.count == 2 and not seg.cuts


@pytest.mark.parametrize("B,HV", [(1, 16), (2, 16), (1, 32), (2, 8), (4, 16), (2, 32)])
def test_dense_count_is_the_plans_count_at_every_length(B, HV):
    """The fake implementation's count (a formula of the shapes) is what the forward keeps."""
    for T in (1, 64, 65, 2047, 2048, 2049, 4096, 8192, 33 * 64 * 32, 33 * 64 * 32 + 1, 131072):
        seg = C.plan(torch.empty(B, T, HV, 128), None)
        assert C.dense_count(B, T, HV, 128, 132) == (0 if seg is None else seg.count), (B, HV, T)


def test_packed_lengths_are_read_only_when_the_shapes_leave_room_and_once_per_tensor(monkeypatch):
    """The plan decides from the shapes when the sequences alone fill half the SMs, without
    reading cu_seqlens (a device sync on the GPU); otherwise it reads it once per tensor."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    many = torch.arange(0, 40 * 4096 + 1, 4096)                     # 40 sequences x 16 heads x 2 blocks
    assert C.plan(torch.empty(1, 40 * 4096, 16, 128), many) is None and reads == []
    few = torch.tensor([0, 4096, 12288])
    seg = C.plan(torch.empty(1, 12288, 16, 128), few)
    assert len(reads) == 1 and reads[0] is few and seg is not None and seg.length == C.MIN_CHUNKS
    assert C.plan(torch.empty(1, 12288, 16, 128), few) is seg        # same tensor: cached bounds and segments
    assert len(reads) == 1
    assert C.plan(torch.empty(1, 12288, 16, 128), few.clone()) is seg and len(reads) == 2


def _inputs(op, B, T, H, HV, K, V, N, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen)) if op == "gdn" else None
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(N, HV, K, V, generator=gen) * 0.3
    do, dht = torch.randn(B, T, HV, V, generator=gen), torch.randn(N, HV, K, V, generator=gen) * 0.3
    return [q, k, v, g, beta, h0], do, dht


def _count_state_passes(monkeypatch) -> list:
    """FLA's recurrences as torch loops; each fwd_h call appends its packed sequence count (None
    for unpacked rows) to the returned list."""
    calls = []

    def fwd_h(**kw):
        calls.append(None if kw.get("cu_seqlens") is None else len(kw["cu_seqlens"]) - 1)
        return loop_fwd_h(**kw)

    replace_recurrences(monkeypatch, fwd_h, loop_bwd_dhu)
    return calls


@pytest.mark.parametrize("op,B,cu", [("gdn", 1, [0, 70, 200, 330]), ("gdn", 1, [0, 70, 70, 200, 330, 330]),
                                     ("gdn", 2, None), ("delta_rule", 1, None)])
def test_function_rebuilds_states_from_checkpoints(op, B, cu, monkeypatch):
    """Policy recompute with 2-chunk segments: the backward's fwd_h call is the segmented one
    (checked), and every gradient matches the torch backend."""
    calls = _count_state_passes(monkeypatch)
    _segment_length(monkeypatch, 2)
    cu = None if cu is None else torch.tensor(cu)
    T = 330 if cu is not None else 130
    N = B if cu is None else len(cu) - 1
    inputs, do, dht = _inputs(op, B, T, H=1 if op == "gdn" else 2, HV=2, K=32, V=16, N=N, seed=21)
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    q, k, v, g, beta, h0 = leaves
    o, ht = triton_entry.triton_gdn_core(q, k, v, g, beta, 32 ** -0.5, h0, True, False, "recompute", cu)
    live = [i for i, t in enumerate(leaves) if t is not None]
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [leaves[i] for i in live])
    # Forward: whole sequences; backward: segments of two chunks (2 per 130-token row, the second
    # one chunk; 1 + 2 + 2 packed).
    expected = B * 2 if cu is None else 5
    assert calls == [None if cu is None else N, expected], calls
    ref_leaves = [None if t is None else t.double().requires_grad_() for t in inputs]   # float64 ground truth
    rq, rk, rv, rg, rb, rh0 = ref_leaves
    kw = dict(scale=32 ** -0.5, initial_state=rh0, output_final_state=True, backend="torch", cu_seqlens=cu)
    if op == "gdn":
        o_ref, ht_ref = rewy_hf.chunk_gated_delta_rule(rq, rk, rv, rg, rb, **kw)
    else:
        o_ref, ht_ref = rewy_hf.chunk_delta_rule(rq, rk, rv, rb, **kw)
    ref = torch.autograd.grad((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum(),
                              [ref_leaves[i] for i in live])
    errors = {i: rel_err(a, b) for i, a, b in zip(live, grads, ref)}
    assert rel_err(o, o_ref) < 2e-5 and max(errors.values()) < 2e-5, errors


def test_function_keeps_the_sequential_rebuild_where_no_sequence_is_cut(monkeypatch):
    """Segments longer than every sequence: the forward keeps one checkpoint per sequence, the
    backward rebuilds sequentially (FLA's dense fwd_h both times) and every gradient matches."""
    calls = _count_state_passes(monkeypatch)
    _segment_length(monkeypatch, 100)
    inputs, do, _ = _inputs("gdn", 2, 130, H=1, HV=2, K=32, V=16, N=2, seed=5)
    inputs[5] = None
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    q, k, v, g, beta, _ = leaves
    o, _ = triton_entry.triton_gdn_core(q, k, v, g, beta, 32 ** -0.5, None, False, False, "recompute", None)
    grads = torch.autograd.grad((o * do).sum(), [q, k, v, g, beta])
    assert calls == [None, None], calls
    ref = [t.double().requires_grad_() for t in inputs[:5]]                             # float64 ground truth
    o_ref, _ = rewy_hf.chunk_gated_delta_rule(*ref, scale=32 ** -0.5, backend="torch")
    ref_grads = torch.autograd.grad((o_ref * do.double()).sum(), ref)
    assert rel_err(o, o_ref) < 2e-5
    assert max(rel_err(a, b) for a, b in zip(grads, ref_grads)) < 2e-5
