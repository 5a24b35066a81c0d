"""rewy's launch of FLA's sequential state recurrences (kernels/triton_backend/state_launch.py), on
CPU: the value-block width rule, which kernel each width launches, and the kernels it builds from FLA's.
FLA's kernels do not run under Triton's interpreter; their outputs at each width are
checked against FLA's own launch on the GPU (test_gpu_state_launch.py)."""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.triton_backend import state_launch
from rewy_hf.kernels.triton_backend.state_launch import narrow_block_v

# (sequences, value heads) of the six bench shapes, V = 128, and the width that was fastest
# there on the H200 for both fwd_h and bwd_dhu, KDA and GDN gates (None: FLA's own launch was
# the fastest or tied with it).
MEASURED = [((8, 16), None), ((4, 16), None), ((2, 16), None), ((1, 16), 16), ((4, 32), None), ((1, 32), None)]


@pytest.mark.parametrize("shape, width", MEASURED)
def test_the_width_rule_gives_the_measured_best_width(shape, width):
    assert narrow_block_v(*shape, 128) == width


def test_the_width_rule_narrows_only_where_flas_widths_leave_sms_idle():
    for n in (1, 2, 3, 5, 8, 16):
        for hv in (1, 4, 16, 32, 64):
            for V in (8, 16, 24, 64, 128, 256):
                bv = narrow_block_v(n, hv, V)
                programs_32 = n * hv * -(-V // 32)
                gains = n * hv * -(-V // 16) > programs_32
                # BV 16 exactly where 32 gives fewer than 128 programs and 16 gives more
                assert (bv == 16) == (programs_32 < state_launch.MIN_PROGRAMS and gains)
                assert bv in (None, 16)


class _Recorder:
    """Stands in for a recurrence kernel: records the grid and the width it is launched with."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **kw: self.calls.append((grid, kw.get("BV")))


@pytest.mark.parametrize("N, HV, V, narrow", [(1, 16, 128, True), (2, 4, 24, True), (8, 16, 128, False),
                                              (1, 2, 16, False)])
def test_each_width_launches_its_kernel_on_its_grid(N, HV, V, narrow, monkeypatch):
    """Where the rule narrows, rewy's relaunch of FLA's kernel runs at BV 16 on N x HV x V / 16
    programs; elsewhere FLA's own kernel runs, its autotuner picking BV, on N x HV x V / BV. Both
    recurrences, rows and packed sequences counted alike (N sequences)."""
    from fla.ops.common import chunk_delta_h as fla

    assert (narrow_block_v(N, HV, V) == 16) is narrow
    ours, theirs = (_Recorder(), _Recorder()), (_Recorder(), _Recorder())
    monkeypatch.setattr(state_launch, "_fwd_h_kernel", ours[0])
    monkeypatch.setattr(state_launch, "_bwd_dhu_kernel", ours[1])
    monkeypatch.setattr(fla, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", theirs[0])
    monkeypatch.setattr(fla, "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", theirs[1])
    T, K = 64 * N, 16
    pk = {} if N == 1 else dict(cu_seqlens=torch.arange(N + 1) * 64)
    k, w, u = torch.zeros(1, T, HV, K), torch.zeros(1, T, HV, K), torch.zeros(1, T, HV, V)
    state_launch.fwd_h(k=k, w=w, u=u, output_final_state=True, **pk)
    state_launch.bwd_dhu(q=k, k=k, w=w, do=u, dv=u, scale=0.25, **pk)
    ran, idle = (ours, theirs) if narrow else (theirs, ours)
    assert all(len(r.calls) == 1 for r in ran) and not any(r.calls for r in idle)
    for grid, bv in (r.calls[0] for r in ran):
        if narrow:
            assert bv == 16 and grid == (N * HV * -(-V // 16),)
        else:
            assert bv is None and all(grid({"BV": b}) == (N * HV * -(-V // b),) for b in (32, 64))


def test_the_kernels_are_flas_under_an_autotuner_of_rewys(monkeypatch):
    """The relaunched kernels are FLA's jit functions with FLA's heuristics, tuned over FLA's
    (num_warps, num_stages) pairs with BV left to the caller and in the key; and the bench
    finds their autotuners, so it forgets their picks between shapes like FLA's."""
    from fla.ops.common import chunk_delta_h as fla

    from rewy_hf.bench.autotune_picks import autotuner_of, autotuners

    fwd, bwd = state_launch.relaunched_kernels()
    for ours, theirs in ((fwd, fla.chunk_gated_delta_rule_fwd_kernel_h_blockdim64),
                         (bwd, fla.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64)):
        assert ours.values.keys() == theirs.values.keys()
        tuner, fla_tuner = autotuner_of(ours), autotuner_of(theirs)
        assert tuner is not fla_tuner and tuner.fn is fla_tuner.fn
        assert all("BV" not in c.kwargs for c in tuner.configs)
        assert {(c.num_warps, c.num_stages) for c in tuner.configs} <= \
            {(c.num_warps, c.num_stages) for c in fla_tuner.configs}
        assert "BV" in tuner.keys and set(fla_tuner.keys) - {"BV"} <= set(tuner.keys)
        assert any(t is tuner for t in autotuners(("rewy_hf.",)))
