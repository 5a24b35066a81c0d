"""The developer bench's `--context-parallel` (`python $REPO/dev/bench_lab --context-parallel`) on two GPUs
(NCCL, one GPU per process): rewy's and FLA's context-parallel ops on the same slices, every row
gradient-checked, both sides timed."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from support.cp_ranks import bench_rank_main, free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one per process)")]


def test_two_gpus_time_both_sides(tmp_path):
    out, codes = tmp_path / "cp.json", str(tmp_path / "code")
    argv = ["bench", "--context-parallel", "--op", "all", "--policy", "recompute", "--boundary", "B",
            "--lift-gdn-guard", "--shapes", "1,8192,4,128,128,packed=2", "--reps", "3", "--json", str(out)]
    mp.spawn(bench_rank_main, args=(2, free_port(), argv, codes), nprocs=2, join=True)
    assert [open(f"{codes}.{r}").read() for r in range(2)] == ["0", "0"]
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["gdn", "kda", "gdn2"]
    for row in rows:
        assert row["pass"], row
        assert set(row["ms"]["B"]) == {"FLA", "rewy"} and min(row["ms"]["B"].values()) > 0, row
