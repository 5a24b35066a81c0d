"""`rewy-hf bench` on CPU: options and shapes, the op-level comparison against the
reference path (times, errors, JSON, plot), a broken core failing the check,
and the model-level training step; GPU tests run FLA as the baseline."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from bench_cli import run_bench, run_lab
from dev_scripts import load_dev_module

from rewy_hf import cli
from rewy_hf.bench.config import CustomShape, check_T, resolve_shapes, suite_file
from rewy_hf.cli.bench import parse_shape
from rewy_hf.op_inputs import Shape

TINY = ["--device", "cpu", "--shapes", "1,64,1,16,16", "--reps", "1", "--warmup", "0"]


def without_check(path, clause: str, prefix: str, tmp_path) -> str:
    """The run at ``path`` as a rewy-hf without the second check ``clause`` wrote it (no clause in
    its check text, no ``prefix``* row fields), saved as old_<name>; returns its path."""
    data = json.loads(path.read_text())
    assert ("; " + clause) in data["settings"]["check"]
    data["settings"]["check"] = data["settings"]["check"].replace("; " + clause, "")
    for row in data["rows"]:
        for key in [k for k in row if k.startswith(prefix)]:
            del row[key]
    old = tmp_path / f"old_{path.name}"
    old.write_text(json.dumps(data))
    return str(old)


@pytest.fixture(scope="module")
def full_policy_run(tmp_path_factory):
    """(op, tmp_path, capsys) -> a copy in tmp_path, named <op>.json, of the one TINY run of op under
    policy full that the tests combining or rewriting such runs share (made on first use)."""
    made = {}
    d = tmp_path_factory.mktemp("full_policy_runs")

    def copy(op, tmp_path, capsys):
        if op not in made:
            path = d / f"{op}.json"
            assert run_bench([*TINY, "--op", op, "--policy", "full", "--json", str(path)], capsys)[0] == 0
            made[op] = path
        return Path(shutil.copy(made[op], tmp_path / f"{op}.json"))

    return copy


# --- options and shapes -------------------------------------------------------------------------

def test_cli_parses_op_level_options():
    args = cli.build_parser().parse_args(
        ["bench", "--op", "gdn", "kda", "--policy", "both", "--boundary", "B", "--shapes", "1,64,2", "2,128,4,32,16",
         "--shapes", "suite", "--lift-gdn-guard", "--json", "x.json", "--plot", "x.png", "--reps", "7"])
    assert args.command == "bench" and args.model is None
    assert args.op == ["gdn", "kda"] and args.policy == ["both"] and args.boundary == ["B"]
    assert args.shapes == [CustomShape(1, 64, 2), CustomShape(2, 128, 4, 32, 16), "suite"]
    assert args.lift_gdn_guard and args.reps == 7 and args.json == "x.json" and args.plot == "x.png"


def test_custom_shapes_resolve_per_device():
    shapes, origin = resolve_shapes([CustomShape(2, 4096, 16)], "cuda")
    assert shapes == [Shape(2, 4096, 16, 128, 128)] and "custom" in origin
    shapes, _ = resolve_shapes([CustomShape(1, 64, 1), CustomShape(1, 64, 1, 16, 32)], "cpu")
    assert shapes == [Shape(1, 64, 1, 64, 64), Shape(1, 64, 1, 16, 32)]


@pytest.mark.parametrize("text, problem", [
    ("2,64", "has 2 value(s)"),
    ("1,2,3,4", "has 4 value(s)"),
    ("2,x,3", "not a list of integers"),
    ("2,0,3", "T=0 must be positive"),
])
def test_bad_shapes_name_the_problem_and_the_fix(text, problem, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="B,T,H") as info:
        parse_shape(text)
    assert problem in str(info.value) and "--shapes 2,4096,16" in str(info.value)
    code, _, err = run_bench(["--shapes", text], capsys)
    assert code == 2 and problem in err


def test_suite_is_shipped_with_the_package():
    from importlib import resources

    shipped = suite_file()
    assert shipped == json.loads(resources.files("rewy_hf.bench").joinpath("bench_shapes.json").read_text())
    assert len(shipped["shapes"]) == 6 and shipped["K"] == shipped["V"] == 128
    shapes, origin = resolve_shapes(None, "cuda")
    assert len(shapes) == 6 and all(s.K == s.V == 128 for s in shapes) and "six-shape suite" in origin
    cpu_shapes, cpu_origin = resolve_shapes(["suite"], "cpu")
    assert cpu_shapes == [Shape(1, 512, 2, 64, 64)] and "CPU suite" in cpu_origin


def test_check_shape_reduction():
    big = Shape(1, 32768, 32, 128, 128)
    assert check_T(big, 2**19) == 16384                          # same B, H; B*T*H now within the budget
    assert check_T(Shape(8, 2048, 16, 128, 128), 2**19) == 2048   # within the budget: checked as timed
    assert check_T(Shape(4, 100, 4, 8, 8), 64) == 64              # never below one chunk


# --- op level on CPU ----------------------------------------------------------------------------

def test_cpu_op_level_every_op_passes_and_writes_json(tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, _ = run_bench([*TINY, "--json", str(report)], capsys)
    assert code == 0, out
    assert "not against FLA" in out and "geometric mean" in out
    data = json.loads(report.read_text())
    assert {"kind", "device", "device_name", "versions", "baseline", "settings", "rows", "geomean", "ok",
            "exit_code", "complete"} <= set(data)
    assert data["ok"] is True and data["exit_code"] == 0 and data["complete"] is True and data["device"] == "cpu"
    assert "NOT against FLA" in data["baseline"]
    assert {"torch", "triton", "flash-linear-attention", "rewy-hf"} <= set(data["versions"])
    assert data["settings"]["ops"] == ["delta_rule", "gdn", "kda", "gdn2"]
    assert data["settings"]["policies"] == ["recompute", "full"] and data["settings"]["boundaries"] == ["B", "FB"]
    rows = data["rows"]
    assert sorted((r["op"], r["policy"]) for r in rows) == sorted(
        (op, p) for op in ("delta_rule", "gdn", "kda", "gdn2") for p in ("recompute", "full"))
    for r in rows:
        assert r["ok"] is True and r["rewy_backend"] == "torch"
        for side in ("baseline", "rewy"):
            for b in ("B", "FB"):
                assert r[f"{side}_{b}_ms"] > 0
        assert r["speedup_B"] > 0 and r["speedup_FB"] > 0
        # float32 chunked vs float64 truth: far inside the bound, and the per-gradient errors add up to the max
        assert r["err_rewy"] < 1e-4 and r["err_rewy"] == max(r["err_rewy_per_grad"].values())
        assert r["err_baseline"] < 1e-6
        assert r["check_T"] == 64 and r["check_reduced"] is False
        # KDA / GDN2 are checked a second time, on gates near the safe lower bound
        if r["op"] in ("kda", "gdn2"):
            assert r["bound_ok"] is True and r["bound_err_rewy"] < 1e-3 and r["bound_err_baseline"] < 1e-6
            assert set(r["bound_err_rewy_per_grad"]) == set(r["err_rewy_per_grad"])
        else:
            assert not any(k.startswith("bound_") for k in r)
    assert "safe lower bound" in data["settings"]["check"]
    assert len(data["geomean"]) == 4 * 2 * 2
    assert all(g["speedup"] > 0 and g["shapes"] == 1 for g in data["geomean"])
    # The tables can be printed again from the JSON alone (e.g. after a GPU run without matplotlib).
    code, again, _ = run_lab(["--from-json", str(report)], capsys)
    assert code == 0 and again.count("geometric mean") == 8 and "gdn2, rewy policy full" in again
    # ... and as Markdown for docs/performance.md: one pipe table per (op, policy), same numbers.
    md = tmp_path / "bench.md"
    code, _, _ = run_lab(["--from-json", str(report), "--markdown", str(md)], capsys)
    text = md.read_text()
    assert code == 0 and text.count("#### ") == 8 and text.count("| geometric mean |") == 8
    assert text.count("| bound err ref | bound err rewy |") == 4    # the KDA and GDN2 tables only
    assert data["device_name"] in text and f"rewy-hf {data['versions']['rewy-hf']}" in text
    r0 = rows[0]
    assert f"| {r0['B']},{r0['T']},{r0['H']}," in text and f"{r0['speedup_B']:.2f}x" in text


def test_runs_split_over_calls_combine_into_one_report(tmp_path, capsys, full_policy_run):
    """One run per op: --from-json takes every file and reports them as one
    run; files from another setup are refused by name."""
    files = [full_policy_run(op, tmp_path, capsys) for op in ("delta_rule", "kda")]
    md = tmp_path / "all.md"
    code, out, _ = run_lab(["--from-json", *map(str, files), "--markdown", str(md)], capsys)
    assert code == 0
    assert "delta_rule, rewy policy full" in out and "kda, rewy policy full" in out and "did not finish" not in out
    assert md.read_text().count("#### ") == 2
    other = json.loads(files[1].read_text())
    other["device_name"] = "another GPU"
    files[1].write_text(json.dumps(other))
    code, _, err = run_lab(["--from-json", *map(str, files)], capsys)
    assert code == 2 and "different device_name" in err and str(files[1]) in err


def test_runs_from_before_the_lower_bound_check_combine_only_without_kda_rows(tmp_path, capsys, full_policy_run):
    """The lower-bound check concerns KDA / GDN2 rows only: a DeltaNet run written before it
    existed (its check text has no such clause) combines with a KDA run that has it, while
    KDA rows with and without the second check, or runs checked differently, are refused."""
    from rewy_hf.bench.config import BOUND_CHECK

    paths = {op: full_policy_run(op, tmp_path, capsys) for op in ("delta_rule", "kda", "gdn2")}

    def older(op):
        return without_check(paths[op], BOUND_CHECK, "bound_", tmp_path)

    md = tmp_path / "merged.md"
    code, out, _ = run_lab(["--from-json", older("delta_rule"), str(paths["kda"]), "--markdown", str(md)], capsys)
    assert code == 0 and "delta_rule, rewy policy full" in out and "kda, rewy policy full" in out
    assert BOUND_CHECK in md.read_text() and "bound err" in md.read_text()
    code, _, err = run_lab(["--from-json", older("kda"), str(paths["gdn2"])], capsys)
    assert code == 2 and "not checked on gates near the safe lower bound" in err and "old_kda.json" in err
    code, _, err = run_lab(["--from-json", older("kda"), older("gdn2")], capsys)
    assert code == 0, err
    changed = json.loads(paths["gdn2"].read_text())
    changed["settings"]["check"] = changed["settings"]["check"].replace("relative", "absolute")
    paths["gdn2"].write_text(json.dumps(changed))
    code, _, err = run_lab(["--from-json", str(paths["kda"]), str(paths["gdn2"])], capsys)
    assert code == 2 and "checked differently" in err


def test_a_run_with_flash_qla_installed_names_that_baseline(tmp_path, capsys, full_policy_run):
    """FLA runs GDN through FlashQLA when flash-qla is installed: a GPU run's tables must
    not call that baseline plain FLA (the run's versions say which it was)."""
    from rewy_hf.bench.op_bench import baseline_description, baseline_label

    assert baseline_label("cuda", {"flash-qla": None}) == "FLA" and baseline_label("cpu", {"flash-qla": "0.1.3"}) == "ref"
    assert baseline_label("cuda", {"flash-qla": "0.1.3"}) == "FLA+QLA"
    assert "FlashQLA" in baseline_description("cuda", {"flash-qla": "0.1.3"})
    assert "FlashQLA" not in baseline_description("cuda", {"flash-qla": None})
    path = full_policy_run("gdn", tmp_path, capsys)
    data = json.loads(path.read_text())
    data["device"], data["versions"]["flash-qla"] = "cuda", "0.1.3"      # as a GPU run with flash-qla records it
    path.write_text(json.dumps(data))
    code, out, _ = run_lab(["--from-json", str(path)], capsys)
    assert code == 0 and "B: FLA+QLA ms" in out and "B: ref ms" not in out


def test_a_run_cut_short_is_completed_by_a_run_of_its_missing_rows(tmp_path, capsys, full_policy_run):
    """A device time limit can stop a run mid-suite; a later run of the missing
    (op, shape) rows makes the combined report whole, and a row timed in both
    files is refused rather than silently picked."""
    cut, rest = tmp_path / "cut.json", full_policy_run("kda", tmp_path, capsys)
    assert run_bench([*TINY, "--op", "delta_rule", "kda", "--policy", "full", "--json", str(cut)], capsys)[0] == 0
    whole = json.loads(cut.read_text())
    short = {**whole, "rows": [r for r in whole["rows"] if r["op"] == "delta_rule"], "complete": False}
    short.pop("exit_code")
    cut.write_text(json.dumps(short))
    code, out, _ = run_lab(["--from-json", str(cut)], capsys)
    assert code == 1 and "did not finish" in out
    code, out, _ = run_lab(["--from-json", str(cut), str(rest)], capsys)
    assert code == 0 and "did not finish" not in out and "kda, rewy policy full" in out
    assert "shapes)" not in out and "not timed" not in out
    # a shape one op lacks is named under its table, whose mean says it covers fewer shapes
    other = tmp_path / "other.json"
    assert run_bench([*TINY[:2], "--shapes", "1,64,2,16,16", *TINY[4:], "--op", "delta_rule", "--policy", "full",
                      "--json", str(other)], capsys)[0] == 0
    code, out, _ = run_lab(["--from-json", str(cut), str(rest), str(other)], capsys)
    assert "geometric mean (1 of 2 shapes)" in out and "not timed for this op and policy: 1,64,2" in out
    cut.write_text(json.dumps(whole))
    code, _, err = run_lab(["--from-json", str(cut), str(rest)], capsys)
    assert code == 2 and "kda (policy full)" in err and "in both" in err


def test_runs_of_one_policy_each_combine_and_keep_their_settings(tmp_path, capsys, monkeypatch):
    """A recompute-only run (--policy recompute) and a full-only run of the same op combine
    into one report with both tables; each file's rewy-hf settings stay attached to it."""
    files = {}
    for policy, flag in (("recompute", "0"), ("full", "1")):
        monkeypatch.setenv("REWY_HF_CHECK_FINITE", flag)
        files[policy] = tmp_path / f"{policy}.json"
        assert run_bench([*TINY, "--op", "gdn", "--policy", policy, "--json", str(files[policy])], capsys)[0] == 0
    paths = [str(files["recompute"]), str(files["full"])]
    code, out, _ = run_lab(["--from-json", *paths], capsys)
    assert code == 0 and "gdn, rewy policy recompute" in out and "gdn, rewy policy full" in out
    assert "did not finish" not in out
    data = load_dev_module("bench_lab", "merge").merge_runs(paths)
    assert data["settings"]["policies"] == ["recompute", "full"] and data["complete"]
    assert {p: e.get("REWY_HF_CHECK_FINITE") for p, e in data["rewy_env"].items()} == dict(zip(paths, "01"))


def test_json_to_stdout_is_only_json_and_records_rewys_two_settings(capsys, monkeypatch):
    """--json -: stdout holds the report alone (tables and progress go to stderr), and the report
    records the library's two settings, not every variable that happens to start with REWY_HF_."""
    monkeypatch.setenv("REWY_HF_CHECK_FINITE", "0")
    monkeypatch.delenv("REWY_HF_TEST_FAULT", raising=False)
    monkeypatch.setenv("REWY_HF_NOT_A_SETTING", "1")
    code, out, err = run_bench([*TINY, "--op", "delta_rule", "--policy", "full", "--boundary", "B", "--json", "-"],
                               capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["complete"] is True and [r["op"] for r in data["rows"]] == ["delta_rule"]
    assert data["rewy_env"] == {"REWY_HF_CHECK_FINITE": "0", "REWY_HF_TEST_FAULT": None}
    assert "geometric mean" in err and "configurations passed" in err


def test_a_broken_core_fails_the_check(tmp_path, capsys, monkeypatch):
    # A spec of its own: rewy warns once per spec and process, other tests expect their own warning.
    monkeypatch.setenv("REWY_HF_TEST_FAULT", "grad_scale=1.07@kda")
    report = tmp_path / "bench.json"
    with pytest.warns(RuntimeWarning, match="deliberately corrupting"):
        code, out, _ = run_bench([*TINY, "--op", "kda", "gdn", "--policy", "full", "--boundary", "B",
                                  "--json", str(report)], capsys)
    assert code == 1
    assert "FAIL" in out and "failed: kda full" in out
    rows = {r["op"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["kda"]["ok"] is False and rows["kda"]["err_rewy"] == pytest.approx(0.07, rel=1e-3)
    assert rows["gdn"]["ok"] is True, "the fault is scoped to the kda op"


def test_bound_gates_sit_near_the_safe_lower_bound():
    from rewy_hf.op_inputs import LOWER_BOUND, make_inputs

    for op in ("kda", "gdn2"):
        inputs, _ = make_inputs(op, Shape(1, 256, 2, 16, 16), "cpu", torch.float32, seed=0, gates="bound")
        g = inputs[3]
        assert g.shape == (1, 256, 2, 16) and bool(((g > LOWER_BOUND) & (g < 0)).all())
        assert g.mean().item() < 0.9 * LOWER_BOUND      # mostly saturated, not spread over (-5, 0)
        logsig, _ = make_inputs(op, Shape(1, 256, 2, 16, 16), "cpu", torch.float32, seed=0)
        assert logsig[3].mean().item() > -2.0
    with pytest.raises(ValueError, match="kda, gdn2, not of gdn"):
        make_inputs("gdn", Shape(1, 64, 1, 16, 16), "cpu", torch.float32, seed=0, gates="bound")


def test_the_lower_bound_check_fails_a_row_on_its_own(tmp_path, capsys, monkeypatch):
    """A core wrong only under safe_gate (the lower-bound path) passes the log-sigmoid
    check and must still fail the row."""
    from rewy_hf.op_inputs import REWY_OPS

    kda = REWY_OPS["kda"]

    def wrong_with_safe_gate(*args, safe_gate=False, **kwargs):
        o, ht = kda(*args, safe_gate=safe_gate, **kwargs)
        if safe_gate:
            o.register_hook(lambda grad: grad * 1.07)
        return o, ht

    monkeypatch.setitem(REWY_OPS, "kda", wrong_with_safe_gate)
    report = tmp_path / "bench.json"
    code, out, _ = run_bench([*TINY, "--op", "kda", "--policy", "full", "--boundary", "B", "--json", str(report)],
                             capsys)
    assert code == 1 and "FAIL" in out
    (row,) = json.loads(report.read_text())["rows"]
    assert row["err_rewy"] < 1e-4 and row["bound_ok"] is False and row["ok"] is False
    assert row["bound_err_rewy"] == pytest.approx(0.07, rel=1e-3)


def test_reduced_check_is_stated(tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, _ = run_bench(["--device", "cpu", "--shapes", "1,256,1,16,16", "--reps", "1", "--warmup", "0",
                              "--op", "gdn", "--policy", "recompute", "--boundary", "FB", "--check-max-tokens", "128",
                              "--json", str(report)], capsys)
    assert code == 0, out
    (row,) = json.loads(report.read_text())["rows"]
    assert row["check_T"] == 128 and row["check_reduced"] is True and row["T"] == 256
    assert "reduced T" in out


def test_fastest_rounds_leave_out_a_stalled_round(tmp_path, capsys):
    """With several rounds per side the tables add a geometric mean over each side's fastest
    round: a round in which the host stalled one side moves the median, not that line."""
    report = tmp_path / "bench.json"
    assert run_bench([*TINY[:4], "--reps", "3", "--warmup", "0", "--op", "delta_rule", "--policy", "full",
                      "--boundary", "B", "--json", str(report)], capsys)[0] == 0
    data = json.loads(report.read_text())
    (row,) = data["rows"]
    base, rewy = row["baseline_B_rounds"], row["rewy_B_rounds"]
    assert len(base) == len(rewy) == 3
    # the baseline's two slower rounds stall for 10x its fastest: its median moves, its fastest does not
    row["baseline_B_rounds"] = [min(base), 10 * min(base), 10 * min(base)]
    row["baseline_B_ms"] = 10 * min(base)
    row["speedup_B"] = row["baseline_B_ms"] / row["rewy_B_ms"]
    report.write_text(json.dumps(data))
    code, out, _ = run_lab(["--from-json", str(report)], capsys)
    assert code == 0
    (median_line,) = [ln for ln in out.splitlines() if ln.startswith("geometric mean ")]
    (fast_line,) = [ln for ln in out.splitlines() if ln.startswith("geometric mean, fastest rounds")]
    assert f"{min(base) / min(rewy):.2f}x" in fast_line and f"{row['speedup_B']:.2f}x" in median_line
    assert "fastest rounds: each side's fastest" in out
    # one round per side: the line would repeat the median, so it is left out
    assert "fastest rounds" not in run_bench([*TINY, "--op", "delta_rule", "--policy", "full"], capsys)[1]


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "speedup.png"
    code, out, _ = run_bench([*TINY, "--op", "gdn2", "kda", "--policy", "recompute", "--plot", str(png)], capsys)
    assert code == 0, out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_matplotlib_fails_before_timing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` raise ImportError
    report = tmp_path / "bench.json"
    code, out, err = run_bench([*TINY, "--plot", str(tmp_path / "x.png"), "--json", str(report)], capsys)
    assert code == 2
    assert "pip install matplotlib" in err
    assert not report.exists() and "geometric mean" not in out


def test_progress_without_tqdm_prints_flushed_lines(capsys, monkeypatch):
    from rewy_hf.bench.runner import Progress

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with Progress(2, "bench") as bar:
        bar.step("gdn 1,64,1")
        bar.write("a result line")
    out = capsys.readouterr()
    assert "[1/2] bench: gdn 1,64,1" in out.err and "a result line" in out.out


# --- model level --------------------------------------------------------------------------------

def test_model_level_on_a_tiny_preset(tmp_path, capsys):
    report = tmp_path / "model.json"
    code, out, _ = run_bench(["--model", "tiny-qwen3.5", "--device", "cpu", "--steps", "2", "--warmup", "0",
                              "--seq-len", "80", "--json", str(report)], capsys)
    assert code == 0, out
    assert "patched layers: 1" in out and "speedup" in out and "reference cores" in out
    data = json.loads(report.read_text())
    assert data["kind"] == "model" and data["ok"] is True and data["settings"]["dtype"] == "float32"
    assert data["patched_layers"] == 1
    assert data["optimized_backward_calls"] == 2, "one patched layer, two timed patched steps"
    assert data["dispatch"]["ops"]["gated_delta_rule"]["optimized_backward_calls"] == 2
    for side in ("unpatched", "patched"):
        assert len(data[side]["step_ms"]) == 2 and data[side]["median_step_ms"] > 0
        assert data[side]["tokens_per_s"] > 0
    # Same weights, optimizer state and batch every step: both sides see the same loss, every step.
    assert data["loss_rel_diff"] < 1e-5
    assert data["unpatched"]["loss"][0] == pytest.approx(data["unpatched"]["loss"][1], rel=1e-6)
    code, again, _ = run_lab(["--from-json", str(report)], capsys)
    assert code == 0 and "patched layers: 1" in again and "guard lifted" not in again
    # A GPU run whose unpatched GDN backward ran with FLA's guard lifted says its gradients are not trusted.
    data["settings"]["gdn_guard"] = {"requested": True, "was_active": True}
    report.write_text(json.dumps(data))
    code, lifted, _ = run_lab(["--from-json", str(report)], capsys)
    assert code == 0 and "guard lifted" in lifted and "not trusted" in lifted


def test_model_level_refuses_op_level_options(capsys):
    code, _, err = run_bench(["--model", "tiny-qwen3.5", "--device", "cpu", "--shapes", "1,64,1"], capsys)
    assert code == 2 and "--shapes" in err and "op-level" in err
    code, _, err = run_bench(["--model", "tiny-qwen3.5", "--device", "cpu", "--policy", "both"], capsys)
    assert code == 2 and "one --policy" in err


def test_model_level_unknown_model_lists_presets(capsys):
    # A path-like name fails the hub id check at once; a bare name would wait on the network.
    code, _, err = run_bench(["--model", "./no-such-model", "--device", "cpu"], capsys)
    assert code == 2
    assert "qwen3.5-1b" in err and "gdn2-1b" in err


def test_bench_presets():
    from rewy_hf.models.loading import ModelLoadError, load_causal_lm
    from rewy_hf.models.presets import PRESETS

    with torch.device("meta"):
        model = PRESETS["qwen3.5-1b"]()
    # the size the published model-level run recorded (docs/bench/model/qwen3.5-1b.json)
    published = json.loads((Path(__file__).resolve().parents[2] / "docs" / "bench" / "model" / "qwen3.5-1b.json")
                           .read_text())["settings"]["parameters"]
    assert sum(p.numel() for p in model.parameters()) == published
    assert model.config.layer_types.count("full_attention") == 5
    assert load_causal_lm("gdn2-tiny").model.config.model_type == "gdn2"
    with pytest.raises(ModelLoadError, match="gdn2-1b"):
        load_causal_lm("gdn2-huge")


# --- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_op_level_against_fla(tmp_path, capsys):
    report = tmp_path / "bench.json"
    # the developer bench: the installed op level, and the autotune picks each row ran with
    code, out, _ = run_lab(["--device", "cuda", "--shapes", "1,512,2", "--reps", "2", "--warmup", "1",
                            "--op", "kda", "gdn2", "delta_rule", "--lift-gdn-guard", "--json", str(report)], capsys)
    data = json.loads(report.read_text())
    assert code == 0, out
    assert data["baseline"].startswith("FLA") and data["settings"]["qkv_dtype"] == "bfloat16"
    assert "forgotten before each shape" in data["settings"]["autotune"] and "\nautotune: Triton" in out
    for r in data["rows"]:
        assert r["ok"] and r["err_baseline"] is not None and r["err_rewy"] < 2e-2
        if r["op"] in ("kda", "gdn2"):      # FLA with safe_gate=True on gates near its lower bound, too
            assert r["bound_ok"] and r["bound_err_baseline"] is not None and r["bound_err_rewy"] < 2e-2
        assert r["baseline_peak_mb"] > 0 and r["rewy_peak_mb"] > 0
        assert all(r[f"{s}_{b}_ms"] > 0 for s in ("baseline", "rewy") for b in ("B", "FB"))
        # the configs the row ran with: rewy's backward kernels of its op and FLA's forward stages
        ran = {name.rsplit(".", 1)[-1] for name in r["autotune_picks"]}
        ours = {"rewy_kda_bwd_wy_kernel", "rewy_kda_bwd_intra_kernel"} if r["op"] != "delta_rule" else \
            {"rewy_gdn_bwd_local_kernel"}
        assert ours <= ran and any(name.startswith("fla.") for name in r["autotune_picks"]), sorted(ran)


@pytest.mark.gpu
def test_gpu_gdn_with_lifted_guard_is_timing_only_where_the_guard_was_active(tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, _ = run_bench(["--device", "cuda", "--shapes", "1,512,2", "--reps", "1", "--warmup", "1", "--op", "gdn",
                              "--policy", "recompute", "--lift-gdn-guard", "--json", str(report)], capsys)
    data = json.loads(report.read_text())
    assert code == 0, out
    (row,) = data["rows"]
    # with flash-qla or tilelang installed FLA serves GDN's backward without the guarded kernel
    on = data["fla_backends_on"]
    bypassed = "flash_qla" in on.get("gated_delta_rule", []) or "tilelang" in on.get("common", [])
    active = data["settings"]["gdn_guard"]["was_active"] and not bypassed
    assert row["baseline_timing_only"] is active
    assert (row["err_baseline"] is None) is active
    assert math.isfinite(row["speedup_B"])


def test_gdn_is_checked_under_strong_decay_and_old_gdn_rows_do_not_combine_with_new(tmp_path, capsys,
                                                                                     full_policy_run):
    """GDN rows carry a second check with a log-gate of about -10 per token (the regime where a
    gate gradient formed as a difference of large terms would fail); a GDN run from before that
    check does not combine with one after it, while a DeltaNet run from before it does."""
    from rewy_hf.bench.config import STRONG_CHECK

    paths = {op: full_policy_run(op, tmp_path, capsys) for op in ("delta_rule", "gdn")}
    gdn = json.loads(paths["gdn"].read_text())
    (row,) = gdn["rows"]
    assert row["strong_ok"] and row["ok"] and row["strong_err_rewy"] < 1e-4, row
    assert "strong_ok" not in json.loads(paths["delta_rule"].read_text())["rows"][0]

    def older(op):
        return without_check(paths[op], STRONG_CHECK, "strong_", tmp_path)

    md = tmp_path / "merged.md"
    code, out, err = run_lab(["--from-json", older("delta_rule"), str(paths["gdn"]), "--markdown", str(md)], capsys)
    assert code == 0, err
    assert STRONG_CHECK in md.read_text() and "strong-decay err" in md.read_text()
    code, _, err = run_lab(["--from-json", older("gdn"), str(paths["gdn"])], capsys)
    assert code == 2 and "not checked under strong decay" in err and "old_gdn.json" in err


def test_packed_shapes_parse_and_split_into_unequal_sequences():
    shape = parse_shape("1,300,2,16,16,packed=4").resolve(64)
    assert shape == Shape(1, 300, 2, 16, 16, N=4) and shape.label == "1,300,2,16,16,packed=4"
    cu = shape.packing("cpu")["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 300 and len(cu) == 5
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert all(x > 0 for x in lengths) and len(set(lengths)) == 4
    assert Shape(2, 64, 2, 16, 16).packing("cpu") == {}
    for bad, why in (("2,300,2,packed=4", "give B = 1"), ("1,3,2,packed=4", "packed <= T"),
                     ("1,300,2,packed=x", "needs an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_shape(bad)


def test_a_packed_row_is_checked_and_timed_with_its_sequences(tmp_path, capsys):
    from rewy_hf.bench.op_bench import reference_grads
    from rewy_hf.op_inputs import make_inputs

    report = tmp_path / "bench.json"
    code, out, _ = run_bench(["--device", "cpu", "--shapes", "1,192,1,16,16,packed=3", "--reps", "1", "--warmup", "0",
                              "--op", "gdn", "--policy", "recompute", "--json", str(report)], capsys)
    assert code == 0, out
    (row,) = json.loads(report.read_text())["rows"]
    assert row["N"] == 3 and row["ok"] and "1,192,1,16,16,packed=3" in out
    # the packed reference is not the dense one: a side that ignored cu_seqlens would fail the check
    shape = Shape(1, 192, 1, 16, 16, N=3)
    inputs, do = make_inputs("gdn", shape, "cpu", torch.float32, 0)
    dense, packed = reference_grads("gdn", inputs, do, "cpu"), reference_grads("gdn", inputs, do, "cpu",
                                                                              shape.packing("cpu"))
    assert (dense[2] - packed[2]).abs().max() > 1e-3
