"""benchmarks/host_time_stubbed.py runs on a machine without a GPU, for rewy's op and FLA's, and
reports a forward and a backward host time for each. It replaces Triton's launch methods for its
whole process, so it runs in a subprocess (and without TRITON_INTERPRET, which it does not need)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_time_stubbed.py"


@pytest.mark.parametrize("side", ["rewy", "fla"])
def test_both_sides_report_forward_and_backward(side):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-P", str(SCRIPT), "--side", side, "--calls", "3", "--repeats", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.strip().splitlines()[-1]
    found = re.findall(r"(forward|backward) min ([0-9.]+) median ([0-9.]+)", line)
    assert [name for name, *_ in found] == ["forward", "backward"], line
    assert all(0 < float(lo) <= float(mid) for _, lo, mid in found), line
    assert line.startswith(f"GDN, {side}")


@pytest.mark.parametrize("direct", ["0", "1"])
def test_autotuners_can_stay_in_the_time(direct):
    """--stub jit: only Triton's jit functions return at once; the autotuners and heuristics run
    (every config reported equally fast), with rewy's launches direct or through them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(REWY_HF_DIRECT_LAUNCH=direct, REWY_HF_STATE_BLOCK_V="fla")
    r = subprocess.run([sys.executable, "-P", str(SCRIPT), "--stub", "jit", "--calls", "3", "--repeats", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("GDN, rewy, policy recompute, jit functions stubbed"), line
    assert len(re.findall(r"(forward|backward) min ([0-9.]+) median", line)) == 2, line
