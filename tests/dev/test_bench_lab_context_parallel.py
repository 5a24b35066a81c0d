"""dev/bench_lab --context-parallel on CPU: two gloo processes time rewy's ops on their slices of
one packed row, each configuration checked against the whole row in one process; FLA's side is
listed as needing CUDA. Runs that cannot start are refused with the launch or the fix."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from support.cp_ranks import bench_rank_main, free_port


def test_two_processes_time_rewy_and_check_every_row(tmp_path, capsys):
    out, codes = tmp_path / "cp.json", str(tmp_path / "code")
    argv = ["bench", "--device", "cpu", "--context-parallel", "--op", "all", "--policy", "recompute", "--shapes",
            "1,192,2,16,16,packed=2", "--reps", "2", "--warmup", "0", "--json", str(out)]
    mp.spawn(bench_rank_main, args=(2, free_port(), argv, codes), nprocs=2, join=True)
    assert [open(f"{codes}.{r}").read() for r in range(2)] == ["0", "0"]
    data = json.loads(out.read_text())
    assert data["kind"] == "context_parallel" and data["processes"] == 2
    assert [(r["op"], r["policy"]) for r in data["rows"]] == [("gdn", "recompute"), ("kda", "recompute"),
                                                               ("gdn2", "recompute")]
    for row in data["rows"]:
        # packed=2: sequences [0, 64) and [64, 192), the second one across the processes' boundary at 96.
        # float32 slices against the float32 whole row: only the order of the sums differs.
        assert row["pass"] and row["err"]["rewy"] <= 1e-5, row
        assert row["tokens_per_process"] == 96 and row["check_T"] == 192
        assert set(row["ms"]) == {"B", "FB"} and all(t["rewy"] > 0 and "FLA" not in t for t in row["ms"].values())
        assert "need CUDA" in row["errors"]["FLA"]
    # the kept JSON gives the same table again, with the run's status
    from bench_cli import lab_main

    capsys.readouterr()
    md = tmp_path / "cp.md"
    assert lab_main(["--from-json", str(out), "--markdown", str(md)]) == 0
    printed = capsys.readouterr().out
    table = md.read_text()
    assert table.count("| gdn2 | recompute | 1,192,2,16,16,packed=2 | 2 |") == 2     # B and FB
    assert table.strip() in printed


@pytest.mark.parametrize("argv,env,fragment", [
    (["--shapes", "1,128,2"], {}, "launch them, e.g. `torchrun --nproc-per-node 2 $REPO/dev/bench_lab --context-parallel"),
    (["--shapes", "2,128,2"], {"WORLD_SIZE": "2", "RANK": "0"}, "give 1,T,H[,K,V][,packed=N] (B = 1"),
    (["--shapes", "1,129,2"], {"WORLD_SIZE": "2", "RANK": "0"}, "T = 129 does not split evenly over 2 processes"),
    (["--shapes", "1,128,2", "--op", "delta_rule"], {"WORLD_SIZE": "2", "RANK": "0"},
     "no context parallelism for delta_rule"),
    ([], {"WORLD_SIZE": "2", "RANK": "0"}, "needs --shapes 1,T,H"),
    (["--shapes", "1,128,2", "--kernel-profile", "--plot", "x.png"], {"WORLD_SIZE": "2", "RANK": "0"},
     "with neither --kernel-profile, --plot; drop them"),
])
def test_runs_that_cannot_start_are_refused(monkeypatch, capsys, argv, env, fragment):
    from bench_cli import lab_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert lab_main(["--device", "cpu", "--context-parallel", *argv]) == 2
    assert fragment in capsys.readouterr().err
