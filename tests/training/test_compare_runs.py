"""dev/compare_runs.py: the table behind the GPU training evidence in docs/training.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The developer scripts live in dev/ at the repository root, not in the installed package.
DEV = Path(__file__).resolve().parents[2] / "dev"
sys.path.insert(0, str(DEV))

from compare_runs import main  # noqa: E402


def _write(d: Path, name: str, losses, step_s: float, ranks: list[int]):
    recs = [{"step": i + 1, "loss": x, "step_time_s": step_s, "tokens_per_s": 1000 / step_s, "peak_mem_gb": 2.0 + i}
            for i, x in enumerate(losses)]
    (d / f"{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    disp = [{"ops": {"gdn2": {"optimized_backward_calls": n}}} for n in ranks]
    (d / f"{name}.dispatch.json").write_text(json.dumps({"dispatch_per_rank": disp}))


def _rows(out: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}


def test_table_reports_loss_gap_speed_and_ranks(tmp_path, capsys):
    _write(tmp_path, "single", [4.0, 3.0, 2.5, 2.0, 1.8], 0.2, [10])
    _write(tmp_path, "ddp", [4.0, 3.1, 2.5, 2.0, 1.9], 0.1, [10, 10])
    assert main([str(tmp_path), "single", "ddp"]) == 0
    rows = _rows(capsys.readouterr().out)
    steps, final, diff, rel, median, within, step_s, tok_s, peak, ranks = rows["ddp"]
    assert (steps, final, step_s, tok_s, peak, ranks) == ("5", "1.9000", "0.100", "10000", "6.0", "[10, 10]")
    assert float(diff) == pytest.approx(0.1) and rel == "5.56% (step 5)"      # worst step: |1.9 - 1.8| / 1.8
    # gaps 0, 3.33 %, 0, 0, 5.56 %: the median step is on the reference, three of five within 0.5 %
    assert median == "0.00%" and within == "3 / 5"
    assert rows["single"][:2] == ["5", "1.8000"] and rows["single"][2:6] == ["-"] * 4
    assert rows["single"][9] == "[10]"


def test_the_tolerance_counts_steps_and_the_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _write(tmp_path, "ref", [4.0, 3.0, 2.0, 1.0], 0.2, [4])
    _write(tmp_path, "run", [4.0, 3.02, 2.1, 0.995], 0.2, [4])     # gaps 0, 0.67 %, 5 %, -0.5 %
    png = tmp_path / "loss.png"
    assert main([str(tmp_path), "ref", "run", "--within", "1", "--png", str(png)]) == 0
    assert _rows(capsys.readouterr().out)["run"][5] == "3 / 4"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main([str(tmp_path), "ref", "run", "--within", "-1"])
    assert "--within must be a percentage" in capsys.readouterr().err


def test_a_missing_run_names_the_file(tmp_path, capsys):
    _write(tmp_path, "single", [4.0, 3.0], 0.2, [10])
    assert main([str(tmp_path), "single", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope.metrics.jsonl not found; copy the run's metrics.jsonl there as nope.metrics.jsonl" in err


def test_runs_as_a_script(tmp_path):
    _write(tmp_path, "a", [2.0, 1.0], 0.2, [4])
    _write(tmp_path, "b", [2.0, 1.5], 0.4, [4])
    proc = subprocess.run([sys.executable, str(DEV / "compare_runs.py"), str(tmp_path), "a", "b"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _rows(proc.stdout)["b"][1] == "1.5000"
