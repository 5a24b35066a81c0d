"""dev/bench_lab --kernel-profile: where each side's time goes, kernel by kernel (on the CPU: ATen
operator by operator), recorded per configuration and boundary and printed beside the other sides'."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench_cli import lab_main, run_lab
from dev_scripts import load_dev_module

from rewy_hf.bench.kernel_profile import summed

lab_kernels = load_dev_module("bench_lab", "kernels")
op_row = load_dev_module("bench_lab", "rows").op_row

# T = 128: two chunks for rewy's chunked backward, 128 token steps for the reference recurrence.
PROFILED = ["--device", "cpu", "--shapes", "1,128,1,16,16", "--reps", "1", "--warmup", "1", "--op", "gdn",
            "--policy", "recompute", "--kernel-profile"]


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """The JSON of one profiled CPU run of GDN, both boundaries, and what it printed."""
    path = tmp_path_factory.mktemp("kernel_profile") / "run.json"
    assert lab_main([*PROFILED, "--json", str(path)]) == 0
    return json.loads(path.read_text()), path


def test_every_timed_side_and_boundary_has_its_profile(profiled_run):
    data, _ = profiled_run
    assert data["settings"]["kernel_profile"] is True
    (row,) = data["rows"]
    for side in ("baseline", "rewy"):
        for boundary in ("B", "FB"):
            kernels = row[f"{side}_kernels_{boundary}"]
            assert kernels and all(v["launches"] >= 1 and v["ms"] >= 0 for v in kernels.values())
            assert sum(v["ms"] for v in kernels.values()) > 0
        # Each profile holds one run: the backward's autograd nodes run as often in the backward's profile
        # as in the forward + backward's (a profile that also caught warm-up or timed runs would not agree).
        # Counted, not timed: the operators' self times move with the host's load.
        nodes = lambda k: {n: v["launches"] for n, v in k.items() if n.startswith("autograd::engine")}  # noqa: E731
        assert nodes(row[f"{side}_kernels_B"]) and nodes(row[f"{side}_kernels_B"]) == nodes(row[f"{side}_kernels_FB"])


def test_the_profiles_tell_the_chunked_backward_from_the_token_recurrence(profiled_run):
    (row,) = profiled_run[0]["rows"]
    rewy, ref = row["rewy_kernels_B"], row["baseline_kernels_B"]
    launches = lambda k: sum(v["launches"] for v in k.values())  # noqa: E731
    # The reference recurrence steps token by token (128 steps, each several operators, and their
    # backward); rewy's torch backend works on two chunks at once.
    assert launches(ref) > 10 * launches(rewy)
    assert any(name in rewy for name in ("aten::bmm", "aten::matmul", "aten::mm"))
    # The forward + backward profile holds the backward's operators and more launches.
    assert set(rewy) <= set(row["rewy_kernels_FB"])
    assert launches(row["rewy_kernels_FB"]) > launches(rewy)


def test_the_tables_print_live_and_again_from_the_json(profiled_run, tmp_path, capsys):
    data, path = profiled_run
    (row,) = data["rows"]
    md = tmp_path / "run.md"
    code, out, _ = run_lab(["--from-json", str(path), "--markdown", str(md)], capsys)
    assert code == 0
    for text in (out, md.read_text()):
        assert "operators of one backward (self CPU time)" in text
        assert "operators of one forward + backward (self CPU time)" in text
    # The "all operators" line of each side is the side's whole profile.
    total = sum(v["ms"] for v in row["rewy_kernels_B"].values())
    launches = sum(v["launches"] for v in row["rewy_kernels_B"].values())
    assert f"| rewy | all operators | {launches} | {total:.3f} | 100 % |" in md.read_text()


def test_a_run_without_the_option_records_and_prints_no_profile(tmp_path, capsys):
    path = tmp_path / "run.json"
    argv = [a for a in PROFILED if a != "--kernel-profile"] + ["--boundary", "B", "--json", str(path)]
    code, out, _ = run_lab(argv, capsys)
    assert code == 0 and "operators of one" not in out
    (row,) = json.loads(path.read_text())["rows"]
    assert not any("kernels" in k for k in row)


def test_the_option_is_refused_at_model_level(capsys):
    code, _, err = run_lab(["--model", "tiny-qwen3.5", "--device", "cpu", "--kernel-profile"], capsys)
    assert code == 2 and "--kernel-profile" in err and "op-level" in err


def _event(kind, name, ms=0.0, self_ms=0.0):
    return SimpleNamespace(device_type=SimpleNamespace(name=kind), name=name, self_cpu_time_total=self_ms * 1e3,
                           time_range=SimpleNamespace(start=0.0, end=ms * 1e3))


def test_gpu_profiles_sum_kernels_and_leave_memsets_and_host_operators_out():
    events = [_event("CUDA", "rewy_gdn_walk_kernel", 0.5), _event("CUDA", "rewy_gdn_walk_kernel", 0.25),
              _event("CUDA", "Memset (Device)", 0.125), _event("CPU", "aten::mm", self_ms=3.0),
              _event("CUDA", "x" * 200, 0.0625)]
    got = summed(events, "cuda")
    assert got == {"rewy_gdn_walk_kernel": {"ms": 0.75, "launches": 2}, "x" * 90: {"ms": 0.0625, "launches": 1}}
    assert summed(events, "cpu") == {"aten::mm": {"ms": 3.0, "launches": 1}}


def test_the_table_keeps_the_largest_kernels_and_sums_the_rest():
    kernels = {f"k{i}": {"ms": float(i), "launches": 2} for i in range(1, lab_kernels.TOP_KERNELS + 4)}
    head, (n_rest, ms_rest, launches_rest) = lab_kernels.largest(kernels, lab_kernels.TOP_KERNELS)
    assert [h[0] for h in head] == [f"k{i}" for i in range(lab_kernels.TOP_KERNELS + 3, 3, -1)]
    assert (n_rest, ms_rest, launches_rest) == (3, 1.0 + 2.0 + 3.0, 6)
    row = {"op": "gdn", "policy": "recompute", "B": 1, "T": 64, "H": 2, "K": 128, "V": 128,
           "rewy_kernels_B": kernels, "peers": {"flash-qla": {"kernels_B": {"fused": {"ms": 2.0, "launches": 1}}}}}
    text = lab_kernels.format_kernel_table(op_row(row), "B", "FLA", "cuda", markdown=True)
    total = sum(v["ms"] for v in kernels.values())
    assert "kernels of one backward (device time)" in text
    assert f"| rewy | (3 other kernels) | 6 | 6.000 | {100 * 6 / total:.0f} % |" in text
    assert f"| rewy | all kernels | {2 * len(kernels)} | {total:.3f} | 100 % |" in text
    assert "| peer flash-qla | fused | 1 | 2.000 | 100 % |" in text
    assert "| FLA |" not in text        # a side without a profile gets no lines


def test_the_table_names_the_config_each_autotuned_kernel_ran_with():
    """With the row's autotune picks, each kernel's line gets the config it ran with (one per distinct
    config, in pick order); kernels without a pick get an empty cell, and the summary lines too."""
    pick = lambda kwargs, w, s: {"key_names": [], "key": [], "kwargs": kwargs, "num_warps": w,  # noqa: E731
                                 "num_stages": s}
    row = {"op": "kda", "policy": "full", "B": 8, "T": 2048, "H": 16, "K": 128, "V": 128,
           "baseline_kernels_B": {"chunk_bwd_kernel_dhu": {"ms": 0.2, "launches": 1}},
           "rewy_kernels_B": {"rewy_kda_bwd_wy_kernel": {"ms": 0.6, "launches": 1},
                              "chunk_bwd_kernel_dhu": {"ms": 0.2, "launches": 1},
                              "vectorized_elementwise_kernel": {"ms": 0.01, "launches": 2}},
           "autotune_picks": {
               "rewy_hf.kernels.triton_backend.vector_gate.wy_backward.rewy_kda_bwd_wy_kernel": [
                   pick({"BV": 64}, 4, 1)],
               "fla.ops.common.chunk_delta_h.chunk_bwd_kernel_dhu": [
                   pick({"BV": 32}, 4, 2), pick({"BV": 64}, 8, 3), pick({"BV": 32}, 4, 2)]}}
    text = lab_kernels.format_kernel_table(op_row(row), "B", "FLA", "cuda", markdown=True)
    assert "| side | kernel | launches | ms | share | config |" in text
    assert "| rewy | rewy_kda_bwd_wy_kernel | 1 | 0.600 | 74 % | BV=64 w4 s1 |" in text
    assert "| FLA | chunk_bwd_kernel_dhu | 1 | 0.200 | 100 % | BV=32 w4 s2; BV=64 w8 s3 |" in text
    assert "| rewy | vectorized_elementwise_kernel | 2 | 0.010 | 1 % |   |" in text   # an empty cell
    del row["autotune_picks"]              # a run from before rows recorded picks: the table as it was
    assert "config" not in lab_kernels.format_kernel_table(op_row(row), "B", "FLA", "cuda", markdown=True)


def test_a_profiled_run_plots_its_kernels_beside_the_speedups(profiled_run, tmp_path, capsys):
    _, path = profiled_run
    png = tmp_path / "speedup.png"
    code, _, _ = run_lab(["--from-json", str(path), "--plot", str(png)], capsys)
    assert code == 0
    for figure in (png, tmp_path / "speedup-kernels.png"):
        data = figure.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # an unprofiled run draws the speedups alone
    plain = tmp_path / "plain.json"
    argv = [a for a in PROFILED if a != "--kernel-profile"] + ["--boundary", "B", "--json", str(plain)]
    assert run_lab(argv, capsys)[0] == 0
    code, out, _ = run_lab(["--from-json", str(plain), "--plot", str(tmp_path / "plain.png")], capsys)
    assert code == 0 and (tmp_path / "plain.png").exists() and not (tmp_path / "plain-kernels.png").exists()


def test_a_side_that_cannot_be_profiled_keeps_its_timing_and_says_why(tmp_path, capsys, monkeypatch):
    real = lab_kernels.kernel_times

    def fails_for_the_reference(run, device):
        out = real(run, device)
        if "aten::select_backward" in out:      # only the token-by-token reference recurrence has these
            raise RuntimeError("profiler unavailable")
        return out

    monkeypatch.setattr(lab_kernels, "kernel_times", fails_for_the_reference)
    path = tmp_path / "run.json"
    code, out, _ = run_lab([*PROFILED, "--boundary", "B", "--json", str(path)], capsys)
    assert code == 0, out
    (row,) = json.loads(path.read_text())["rows"]
    assert row["baseline_B_ms"] > 0 and "baseline_kernels_B" not in row and row["rewy_kernels_B"]
    assert row["kernel_profile_errors"] == {"B": {"baseline": "RuntimeError: profiler unavailable"}}
    assert "ref: not profiled: RuntimeError: profiler unavailable" in out
