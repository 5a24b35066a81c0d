"""The four-sided model bench (`rewy-hf bench --model X --compile`) on CPU.

A tiny Qwen3.5 compiled with the ``aot_eager_decomp_partition`` backend (AOT
autograd with inductor's decompositions and partitioner, no code generation)
keeps this fast (plain ``aot_eager`` fails on the unpatched side: its backward
views a non-contiguous gradient in transformers' torch GDN code); the timing numbers themselves mean nothing here, the properties do:
every side ran the same steps from the same weights, the patched sides reached
rewy's backward, the compiled sides compiled without a graph break, their loss
curves track the unpatched eager one, and a further length is reported.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rewy_hf.bench.compile_bench import HELD_KERNELS, SIDES, compile_problems, run_compile_bench
from rewy_hf.bench.kernel_profile import KERNEL_GROUPS, kernel_group
from rewy_hf.bench.model_bench import ModelSettings
from rewy_hf.bench.tables import format_compile_result

import hf_tiny_models as hf
from dev_scripts import load_dev_module


@pytest.fixture(scope="module")
def result():
    from transformers.utils import logging

    torch._dynamo.reset()
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    model = hf.one_layer_qwen3_5()
    s = ModelSettings(device="cpu", steps=1, warmup=1, batch_size=2, seq_len=80, backend="torch",
                      policy="recompute", seed=3)
    try:
        yield run_compile_bench(model, s, curve_steps=3, lengths=(96, 112), compiler="aot_eager_decomp_partition")
    finally:
        torch._dynamo.reset()
        logging.set_verbosity(level)


def test_every_side_ran_and_patched_sides_reached_rewy(result):
    assert list(result["sides"]) == list(SIDES)
    assert compile_problems(result) == []
    for side, row in result["sides"].items():
        assert len(row["step_ms"]) == 1 and row["median_step_ms"] > 0
        assert len(row["loss"]) == 2
        # every timed step starts from the same weights and optimizer state: the same loss each time
        assert max(row["loss"]) - min(row["loss"]) <= 1e-6 * abs(row["loss"][0])
        assert row["first_loss_rel_diff"] < 1e-5, side
    assert result["sides"]["unpatched eager"]["speedup_vs_unpatched_eager"] == 1.0
    # on CPU the unpatched sides run reference cores, so no side claims the installed kernels
    # (test_installed_kernels.py checks the hold itself; the label is the GPU run's)
    assert not any("core_under_compile" in row for row in result["sides"].values())
    labelled = {**result, "sides": {**result["sides"], "unpatched compiled": {
        **result["sides"]["unpatched compiled"], "core_under_compile": HELD_KERNELS}}}
    assert f"unpatched compiled: its delta-rule calls ran {HELD_KERNELS}" in format_compile_result(labelled, "tiny")


def test_compiled_sides_have_no_graph_break_and_a_second_length_does_not_recompile(result):
    patched = result["sides"]["patched compiled"]
    assert patched["graph_breaks"] == 0, patched["break_reasons"]
    assert patched["graphs"] >= 1
    counts = patched["graphs_compiled_at_length"]
    assert list(counts) == ["96", "112"]
    # the first new length turns the sequence dimension dynamic (one compile); the next reuses it
    assert counts["96"] <= 1 and counts["112"] == 0
    assert "graphs_compiled_at_length" not in result["sides"]["patched eager"]


def test_loss_curves_train_and_track_unpatched_eager(result):
    base = result["sides"]["unpatched eager"]["curve_loss"]
    # fresh corpus batches: three different losses, all of them finite
    assert len(base) == 3 and len(set(base)) == 3 and all(math.isfinite(x) for x in base)
    assert result["curve"]["batches"].startswith("a fresh batch each step")
    for side in SIDES[1:]:
        assert result["sides"][side]["curve_max_rel_diff"] < 1e-5, side


def test_tables_and_json_round_trip(result, tmp_path):
    text = format_compile_result(result, "tiny")
    for side in SIDES:
        assert side in text
    assert "T=112: 0" in text and "loss over 3 training steps" in text
    data = {"kind": "model", "device_name": "CPU", "versions": {"torch": torch.__version__},
            "settings": {"model": "tiny"}, "complete": True, **result}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    md = load_dev_module("bench_lab", "reports").markdown_text(json.loads(path.read_text()))
    header = next(line for line in md.splitlines() if line.startswith("| side"))
    assert header.count("|") == 9 + len(KERNEL_GROUPS)
    assert sum(line.startswith(f"| {side} |") for side in SIDES for line in md.splitlines()) == 4


@pytest.mark.parametrize("name,family", [
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "core"),
    ("ampere_bf16_s16816gemm_bf16_128x128", "gemm"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTT", "gemm"),
    ("flash_fwd_kernel", "attention"),
    ("multi_tensor_apply_kernel", "optimizer"),
    ("causal_conv1d_fwd_kernel", "conv"),
    ("triton_poi_fused_add_mul_0", "elementwise"),
])
def test_kernel_family(name, family):
    assert kernel_group(name) == family


def test_a_subset_of_sides_runs_only_those_and_summarizes_what_it_can():
    torch._dynamo.reset()
    model = hf.one_layer_qwen3_5()
    s = ModelSettings(device="cpu", steps=1, warmup=1, batch_size=1, seq_len=64, backend="torch",
                      policy="recompute", seed=5)
    res = run_compile_bench(model, s, sides=("patched eager", "unpatched eager"))
    assert list(res["sides"]) == ["unpatched eager", "patched eager"]      # SIDES' order, whatever was asked
    assert "speedup_vs_unpatched_compiled" not in res
    assert res["sides"]["patched eager"]["first_loss_rel_diff"] < 1e-5
    with pytest.raises(ValueError, match="choose one or more of"):
        run_compile_bench(model, s, sides=("patched",))


def _run_file(tmp_path, name: str, result: dict, sides: list[str], **settings) -> str:
    data = {"kind": "model", "device_name": "CPU", "versions": {"torch": torch.__version__},
            "settings": {"model": "tiny", "seed": 3, "sides": sides, **settings}, "complete": True, "ok": True,
            "exit_code": 0, "tokens_per_step": result["tokens_per_step"],
            "sides": {side: result["sides"][side] for side in sides}}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_split_runs_join_into_the_four_sided_result(result, tmp_path):
    merge = load_dev_module("bench_lab", "merge")
    MergeError, merge_runs = merge.MergeError, merge.merge_runs

    a = _run_file(tmp_path, "a.json", result, ["unpatched eager", "patched eager", "patched compiled"])
    b = _run_file(tmp_path, "b.json", result, ["unpatched compiled"])
    merged = merge_runs([b, a])
    assert list(merged["sides"]) == list(SIDES) and merged["complete"] and merged["settings"]["sides"] == list(SIDES)
    assert merged["speedup_vs_unpatched_compiled"] == pytest.approx(result["speedup_vs_unpatched_compiled"], rel=1e-12)
    for side in SIDES:
        assert merged["sides"][side]["curve_max_rel_diff"] == pytest.approx(result["sides"][side]["curve_max_rel_diff"])
    text = format_compile_result(merged, "tiny")
    assert "not measured" not in text and "b.json: unpatched compiled" in text

    with pytest.raises(MergeError, match="unpatched compiled side is in both"):
        merge_runs([a, b, b])
    other = _run_file(tmp_path, "c.json", result, ["unpatched compiled"], seed=4)
    with pytest.raises(MergeError, match="different seed"):
        merge_runs([a, other])
    # further lengths are per compiled side: a run with them joins one without, and each side keeps its counts
    longer = _run_file(tmp_path, "d.json", result, ["unpatched eager", "patched compiled"], lengths=[96, 112])
    shorter = _run_file(tmp_path, "e.json", result, ["unpatched compiled"], lengths=[])
    joined = merge_runs([longer, shorter])
    assert joined["settings"]["lengths"] == [96, 112]
    assert "patched compiled: graphs compiled by one step at each further length: T=96" in \
        format_compile_result(joined, "tiny")


def test_a_run_of_some_sides_says_which_were_left_out(result, tmp_path):
    path = _run_file(tmp_path, "a.json", result, ["unpatched eager", "patched compiled"])
    data = load_dev_module("bench_lab", "merge").load_run(path)
    text = format_compile_result(data, "tiny")
    assert "not asked for (--sides): patched eager, unpatched compiled" in text and "not measured" not in text


@pytest.mark.parametrize("text,ok", [("patched-compiled,unpatched-eager", ("unpatched eager", "patched compiled")),
                                     ("patched", None), ("", None)])
def test_sides_option(text, ok):
    import argparse

    from rewy_hf.cli.bench import parse_sides

    if ok is None:
        with pytest.raises(argparse.ArgumentTypeError, match="sides are unpatched-eager"):
            parse_sides(text)
    else:
        assert parse_sides(text) == ok


def test_curve_batches_are_fresh_text_windows_and_repeat_with_the_seed():
    from types import SimpleNamespace

    from rewy_hf.bench.compile_bench import corpus_batches

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=200))
    s = ModelSettings(device="cpu", steps=1, warmup=1, batch_size=2, seq_len=5000, backend="torch",
                      policy="recompute", seed=3)
    batches = corpus_batches(model, s, 4)          # longer windows than the corpus holds bytes: it repeats
    assert [tuple(b.shape) for b in batches] == [(2, 5000)] * 4
    assert all(int(b.max()) < 200 and int(b.min()) >= 0 for b in batches)
    assert len({tuple(b[0, :50].tolist()) for b in batches}) == 4
    assert all(torch.equal(a, b) for a, b in zip(batches, corpus_batches(model, s, 4)))


def test_causal_masks_hand_compiled_attention_no_mask():
    """--causal-masks: the compiled side's attention gets SDPA's causal path, and its first step's loss
    is the unpatched eager one."""
    from unittest import mock

    import torch.nn.functional as F

    torch._dynamo.reset()
    model = hf.build("qwen3_5")
    s = ModelSettings(device="cpu", steps=1, warmup=1, batch_size=1, seq_len=64, backend="torch",
                      policy="recompute", seed=5)
    seen, sdpa = [], F.scaled_dot_product_attention

    def watching(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    with mock.patch.object(F, "scaled_dot_product_attention", watching):
        res = run_compile_bench(model, s, sides=("unpatched eager", "patched compiled"), causal_masks=True,
                                compiler="aot_eager_decomp_partition")
    torch._dynamo.reset()
    assert set(seen) == {(True, True)}
    assert res["sides"]["patched compiled"]["first_loss_rel_diff"] < 1e-5
