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

import pytest
import torch

from rewy_hf.bench.compile_bench import (FAMILIES, SIDES, compile_problems, format_compile_result, kernel_family,
                                         run_compile_bench)
from rewy_hf.bench.model_bench import ModelSettings
from rewy_hf.bench.output import markdown_report

import hf_tiny_models as hf


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
    assert len(base) == 3 and base[-1] < base[0]       # the curve steps really train
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
    md = markdown_report(json.loads(path.read_text()), "FLA")
    header = next(line for line in md.splitlines() if line.startswith("| side"))
    assert header.count("|") == 9 + len(FAMILIES)
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
    assert kernel_family(name) == family
