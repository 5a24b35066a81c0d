"""rewy's launch of FLA's sequential state recurrences (kernels/state_launch.py), on CPU:
the value-block width rule, the opt-in switch, and the kernels it builds from FLA's.
FLA's kernels do not run under Triton's interpreter; their outputs at each width are
checked against FLA's own launch on the GPU (test_gpu_state_launch.py)."""

from __future__ import annotations

import pytest

from rewy_hf.kernels import state_launch
from rewy_hf.kernels.state_launch import STATE_BLOCK_V_ENV, narrow_block_v, state_block_v

# (sequences, value heads) of the six bench shapes, V = 128, and the width that was fastest
# there on the H200 for both fwd_h and bwd_dhu, KDA and GDN gates (eleventh session,
# timing_gaps.py --state-widths; None: FLA's own launch was the fastest or tied with it).
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


def test_the_rule_is_on_by_default_and_the_switch_names_its_values(monkeypatch):
    monkeypatch.delenv(STATE_BLOCK_V_ENV, raising=False)
    assert state_block_v(1, 16, 128) == 16 and state_block_v(8, 16, 128) is None
    monkeypatch.setenv(STATE_BLOCK_V_ENV, "auto")
    assert state_block_v(1, 16, 128) == 16 and state_block_v(1, 32, 128) is None
    monkeypatch.setenv(STATE_BLOCK_V_ENV, "fla")
    assert state_block_v(1, 16, 128) is None
    monkeypatch.setenv(STATE_BLOCK_V_ENV, " 32 ")
    assert state_block_v(8, 16, 128) == 32
    for bad in ("48", "programs", "-16"):
        monkeypatch.setenv(STATE_BLOCK_V_ENV, bad)
        with pytest.raises(ValueError, match=f"{STATE_BLOCK_V_ENV}=.*auto.*fla"):
            state_block_v(1, 16, 128)


@pytest.mark.parametrize("mode", [None, "fla"])
def test_where_the_rule_does_not_narrow_flas_launch_runs_unchanged(monkeypatch, mode):
    """Where BV 32 gives enough programs (by default) or with REWY_HF_STATE_BLOCK_V=fla, rewy calls
    FLA's own launch functions with every argument as given (unless REWY_HF_DIRECT_LAUNCH=1)."""
    monkeypatch.setenv("REWY_HF_DIRECT_LAUNCH", "0")
    if mode is None:
        monkeypatch.delenv(STATE_BLOCK_V_ENV, raising=False)
    else:
        monkeypatch.setenv(STATE_BLOCK_V_ENV, mode)
    import torch

    calls = []

    def fla_launch(**kw):
        calls.append(kw)
        return "fla's result"

    k = torch.zeros(1, 64, 2, 16)
    u = torch.zeros(1, 64, 2, 8)
    assert state_launch.fwd_h(fla_launch, k=k, w=k, u=u, gk=k, output_final_state=True,
                              state_v_first=True) == "fla's result"
    assert calls[-1]["k"] is k and calls[-1]["u"] is u and calls[-1]["state_v_first"] is True
    assert calls[-1]["output_final_state"] is True and calls[-1]["g"] is None and calls[-1]["chunk_size"] == 64
    assert state_launch.bwd_dhu(fla_launch, q=k, k=k, w=k, do=u, dv=u, g=None, gk=k, scale=0.25) == "fla's result"
    assert calls[-1]["dv"] is u and calls[-1]["scale"] == 0.25 and calls[-1]["gk"] is k


def test_the_kernels_are_flas_under_an_autotuner_of_rewys(monkeypatch):
    """The relaunched kernels are FLA's jit functions with FLA's heuristics, tuned over FLA's
    (num_warps, num_stages) pairs with BV left to the caller and in the key; and the bench
    finds their autotuners, so it forgets their picks between shapes like FLA's."""
    from fla.ops.common import chunk_delta_h as fla

    from rewy_hf.autotune_picks import autotuner_of, autotuners

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
