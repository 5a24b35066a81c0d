"""dev/bench_lab --peers: further baselines timed beside FLA as installed, each gradient-checked; on
the CPU every peer is listed with the reason it does not apply, and a peer that applies (here a stand-in
for one) is checked, timed in the same rounds, profiled and tabled as on a GPU."""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench_cli import run_lab
from dev_scripts import load_dev_module

from rewy_hf.bench.op_bench import cpu_baseline_impl
from rewy_hf.bench.tables import ms_cell

TINY = ["--device", "cpu", "--shapes", "1,64,1,16,16", "--reps", "1", "--warmup", "0"]


def test_peers_that_do_not_apply_are_listed_with_the_reason(tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, _ = run_lab([*TINY, "--op", "gdn", "--policy", "recompute", "--peers", "all", "--json", str(report)],
                           capsys)
    assert code == 0, out
    data = json.loads(report.read_text())
    assert data["settings"]["peers"] == ["fla-triton", "flash-qla"] and data["fla_backends_on"] == {}
    (row,) = data["rows"]
    assert set(row["peers"]) == {"fla-triton", "flash-qla"}
    assert all("a CPU run has none" in p["skipped"] for p in row["peers"].values())
    assert "peers beside ref" in out and "fla-triton: not timed: peers are FLA's" in out


def test_peers_are_an_op_level_option(capsys):
    code, _, err = run_lab(["--model", "tiny-qwen3.5", "--peers", "all", "--device", "cpu"], capsys)
    assert code == 2 and "--peers apply to the op-level bench" in err


def test_a_peer_that_applies_is_checked_timed_and_profiled(tmp_path, capsys, monkeypatch):
    """A stand-in peer (the reference recurrence again) goes the whole way a GPU peer goes: its check,
    its rounds beside the two sides, its speed-up, its kernels, its table and line, and its JSON."""
    peers = load_dev_module("bench_lab", "peers")
    real = peers.peer_impl

    def stand_in(op, name, policy, gdn_guard, device):
        return cpu_baseline_impl(op) if name == "fla-triton" else real(op, name, policy, gdn_guard, device)

    monkeypatch.setattr(peers, "peer_impl", stand_in)
    report = tmp_path / "bench.json"
    code, out, _ = run_lab([*TINY, "--op", "gdn", "--policy", "recompute", "--boundary", "B", "--peers", "all",
                            "--kernel-profile", "--json", str(report)], capsys)
    assert code == 0, out
    (row,) = json.loads(report.read_text())["rows"]
    peer = row["peers"]["fla-triton"]
    assert peer["B_ms"] > 0 and len(peer["B_rounds"]) == 1 and peer["err"] < 1e-6, peer
    assert peer["speedup_B"] == pytest.approx(peer["B_ms"] / row["rewy_B_ms"])
    assert peer["kernels_B"] and "skipped" in row["peers"]["flash-qla"]
    assert "; fla-triton B " in out and "| peer fla-triton |" not in out
    md = tmp_path / "bench.md"
    code, again, _ = run_lab(["--from-json", str(report), "--markdown", str(md)], capsys)
    assert code == 0
    table = md.read_text()
    assert f"| 1,64,1 | fla-triton | {ms_cell(peer['B_ms'])} |" in table and "| geometric mean | fla-triton |" in table
    assert "| peer fla-triton | all operators |" in table and "peers beside ref" in again


@pytest.mark.gpu
def test_gpu_peers_are_timed_and_checked_where_they_apply(tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, _ = run_lab(["--device", "cuda", "--shapes", "1,512,2", "--reps", "1", "--warmup", "1", "--op", "gdn",
                            "kda", "--policy", "recompute", "--lift-gdn-guard", "--peers", "all", "--json",
                            str(report)], capsys)
    data = json.loads(report.read_text())
    assert code == 0, out
    timed = 0
    for row in data["rows"]:
        for name, p in row["peers"].items():
            if "skipped" in p:
                # a peer is skipped only for its stated reason: flash-qla absent (or not GDN), FLA's
                # Triton path identical to FLA as installed where no FLA backend is on
                if name == "flash-qla":
                    assert "not installed" in p["skipped"] or row["op"] != "gdn", p
                else:
                    assert not data["fla_backends_on"] and "no FLA backend is on" in p["skipped"], p
                continue
            timed += 1
            assert "error" not in p, p
            assert p["B_ms"] > 0 and p["FB_ms"] > 0 and p["peak_mb"] > 0
            assert p["timing_only"] or p["err"] < 2e-2
            if name == "fla-triton":
                assert p["served_by"] == []         # no FLA backend ran with the dispatch off
    installed = importlib.util.find_spec("flash_qla") is not None
    assert timed or not (data["fla_backends_on"] or installed), "a peer that applies here was not timed"
