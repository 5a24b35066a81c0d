"""dev/cpu_backend.py: the torch backend against transformers' own torch path on the same inputs,
at a small shape; its gradient check is the part a test can hold it to (its timings are not asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The developer scripts live in dev/ at the repository root, not in the installed package.
DEV = Path(__file__).resolve().parents[2] / "dev"
sys.path.insert(0, str(DEV))

import cpu_backend  # noqa: E402


def test_matches_transformers_torch_path_and_writes_json(tmp_path):
    out = tmp_path / "cpu.json"
    assert cpu_backend.main(["--T", "96", "--H", "2", "--K", "32", "--V", "32", "--reps", "1", "--warmup", "0",
                             "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and result["shape"]["T"] == 96
    for side in ("rewy[recompute]", "rewy[full]"):
        errors = result["rel_err"][side]
        assert set(errors) == set(cpu_backend.NAMES)
        assert max(errors.values()) <= 1e-4, (side, errors)
    assert all(ms > 0 for ms in result["median_ms"].values())
