"""The op bench forgets Triton's autotune picks before each shape (rewy_hf/bench/autotune_picks.py), and
the developer bench records the picks each row ran with (dev/bench_lab/kernels.py)."""

from __future__ import annotations

import triton

from dev_scripts import load_dev_module

from rewy_hf.bench.autotune_picks import autotuner_of, autotuners, forget_picks
from rewy_hf.cli import build_parser

picks = load_dev_module("bench_lab", "kernels").picks


def _fla_dhu_tuner():
    from fla.ops.common import chunk_delta_h

    tuner = chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64
    assert not hasattr(tuner, "cache")          # FLA wraps its autotuner in triton.heuristics
    return tuner.fn


def test_picks_of_rewy_and_fla_kernels_are_forgotten():
    """Both sides' autotuners are found, the heuristics-wrapped FLA ones too, and a pick made at
    an earlier shape is gone afterwards, with the on-disk result cache off so it cannot come back."""
    from rewy_hf.kernels.triton_backend.vector_gate import wy_backward

    ours, fla = wy_backward.rewy_kda_bwd_wy_kernel, _fla_dhu_tuner()
    found = autotuners()
    assert any(t is ours for t in found) and any(t is fla for t in found)
    assert len({id(t) for t in found}) == len(found)
    for tuner in (ours, fla):
        tuner.cache[("an earlier shape",)] = tuner.configs[0]
        tuner.cache_results = True
    try:
        assert forget_picks() == len(found)
        for tuner in (ours, fla):
            assert tuner.cache == {} and tuner.cache_results is False
    finally:
        for tuner in (ours, fla):
            tuner.cache.pop(("an earlier shape",), None)


def test_picks_name_each_kernel_its_key_and_its_config():
    """A pick reads back as the kernel's module and name, the key's values beside the autotuner's key
    names (then the tensor dtypes, as Triton builds the key) and the chosen config; kernels that
    chose nothing are left out, and the record is plain JSON."""
    import json

    from rewy_hf.kernels.triton_backend.vector_gate import wy_backward

    ours, fla = wy_backward.rewy_kda_bwd_wy_kernel, _fla_dhu_tuner()
    key = (1, 16, 16, 128, 128, 64, False, False, "torch.bfloat16", "torch.float32")
    chosen = triton.Config({"BV": 64}, num_warps=8, num_stages=3)
    forget_picks()
    assert picks() == {}
    ours.cache[key] = chosen
    fla.cache[("fla key",)] = fla.configs[0]
    try:
        got = json.loads(json.dumps(picks()))
        name = "rewy_hf.kernels.triton_backend.vector_gate.wy_backward.rewy_kda_bwd_wy_kernel"
        assert got[name] == [{"key_names": ["SIZE", "H", "HV", "K", "V", "BK", "VEC", "STATE_V_FIRST"],
                              "key": list(key), "kwargs": {"BV": 64}, "num_warps": 8, "num_stages": 3}]
        (fla_name,) = [n for n in got if n != name]
        assert fla_name.startswith("fla.ops.common.chunk_delta_h.") and got[fla_name][0]["key"] == ["fla key"]
    finally:
        ours.cache.pop(key, None)
        fla.cache.pop(("fla key",), None)


def test_only_the_named_modules_are_touched():
    from rewy_hf.kernels.triton_backend.vector_gate import intra_backward

    fla, ours = _fla_dhu_tuner(), intra_backward.rewy_kda_bwd_intra_kernel
    fla.cache[("kept",)] = fla.configs[0]
    ours.cache[("dropped",)] = ours.configs[0]
    try:
        forget_picks(("rewy_hf.",))
        assert ("kept",) in fla.cache and ("dropped",) not in ours.cache
        assert all(isinstance(t, triton.runtime.autotuner.Autotuner) for t in autotuners(("rewy_hf.",)))
    finally:
        fla.cache.pop(("kept",), None)
        ours.cache.pop(("dropped",), None)


def test_bench_keeps_picks_only_when_asked():
    parser = build_parser()
    assert parser.parse_args(["bench"]).keep_autotune_picks is False
    assert parser.parse_args(["bench", "--keep-autotune-picks"]).keep_autotune_picks is True


def test_bench_loads_every_kernel_module_before_the_first_shape():
    """Autotuners imported only at an op's first call would miss the first forget_picks and keep
    their on-disk result cache; the bench imports FLA's op modules and rewy's kernels up front."""
    import sys

    from rewy_hf.bench.op_bench import fla_function, load_kernel_modules

    load_kernel_modules(["gdn2", "delta_rule"])
    assert fla_function("gdn2").__module__ in sys.modules
    names = {getattr(t.fn, "__name__", "") for t in autotuners()}
    rewys = {"rewy_gdn_bwd_local_kernel", "rewy_gdn_prestage_kernel", "rewy_gdn_walk_kernel",
             "rewy_kda_bwd_wy_kernel", "rewy_kda_bwd_intra_kernel"}
    assert rewys <= names and "chunk_gdn2_bwd_kernel_intra" in names
    # rewy's relaunch of FLA's state recurrences (built lazily) is there from the first shape on too
    from rewy_hf.kernels.triton_backend import state_launch

    found = {id(t) for t in autotuners()}
    assert all(id(autotuner_of(k)) in found for k in (state_launch._fwd_h_kernel, state_launch._bwd_dhu_kernel))
