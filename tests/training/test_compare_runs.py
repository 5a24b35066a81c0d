"""tools/compare_runs.py: the table behind the GPU training evidence in docs/training.md."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compare_runs.py"


def _write(d: Path, name: str, losses, step_s: float, ranks: list[int]):
    recs = [{"step": i + 1, "loss": x, "step_time_s": step_s, "tokens_per_s": 1000 / step_s, "peak_mem_gb": 2.0 + i}
            for i, x in enumerate(losses)]
    (d / f"{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    disp = [{"ops": {"gdn2": {"optimized_backward_calls": n}}} for n in ranks]
    (d / f"{name}.dispatch.json").write_text(json.dumps({"dispatch_per_rank": disp}))


def test_table_reports_loss_gap_speed_and_ranks(tmp_path, capsys, monkeypatch):
    _write(tmp_path, "single", [4.0, 3.0, 2.5, 2.0, 1.8], 0.2, [10])
    _write(tmp_path, "ddp", [4.0, 3.1, 2.5, 2.0, 1.9], 0.1, [10, 10])
    monkeypatch.setattr(sys, "argv", ["compare_runs.py", str(tmp_path), "single", "ddp"])
    runpy.run_path(str(TOOL), run_name="__main__")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    steps, final, diff, rel, step_s, tok_s, peak, ranks = rows["ddp"]
    assert (steps, final, step_s, tok_s, peak, ranks) == ("5", "1.9000", "0.100", "10000", "6.0", "[10, 10]")
    assert float(diff) == pytest.approx(0.1) and rel == "5.56%"      # worst step: |1.9 - 1.8| / 1.8
    assert rows["single"][7] == "[10]"
