"""`rewy-hf verify` on CPU: every check passes on a good install, and a broken
core turns the model rows red."""

from __future__ import annotations

import json

import pytest
import torch

from rewy_hf.cli import main
from rewy_hf.parity.comparison import DEFAULT_TOLERANCES, compare


def test_verify_passes_and_writes_json(tmp_path, capsys):
    report = tmp_path / "verify.json"
    assert main(["verify", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "12 of 12 checks passed" in out
    data = json.loads(report.read_text())
    assert data["ok"] is True and data["device"] == "cpu"
    checks = {c["check"]: c for c in data["checks"]}
    assert {"env", "ops", "models"} == {c["group"] for c in data["checks"]}
    assert checks["tiny-fla-gdn2 parity"]["ok"] and "optimized backward" in checks["tiny-fla-gdn2 parity"]["detail"]
    assert all(c["ok"] for c in data["checks"])


def test_a_broken_core_and_a_crashing_preset_fail_their_own_rows_only(capsys, monkeypatch):
    """One run of the models group with two faults: a core broken for the kda op only turns both
    KDA models' rows red and no other, and a preset that crashes inside the unpatched model fails
    its own row while the presets after it still run."""
    import rewy_hf.models.loading as loading

    monkeypatch.setenv("REWY_HF_TEST_FAULT", "grad_scale=1.05@kda")
    real = loading.load_causal_lm

    def load(spec, **kwargs):
        if spec == "tiny-fla-gdn":
            raise RuntimeError("simulated: this preset cannot run here")
        return real(spec, **kwargs)

    monkeypatch.setattr(loading, "load_causal_lm", load)
    with pytest.warns(RuntimeWarning, match="deliberately corrupting"):
        code = main(["verify", "--only", "models"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL  tiny-kimi-linear parity" in out and "FAIL  tiny-fla-kda parity" in out
    assert "FAIL  tiny-fla-gdn parity" in out and "simulated: this preset cannot run here" in out
    for preset in ("tiny-qwen3.5", "tiny-fla-deltanet", "tiny-fla-gdn2"):   # the fault is scoped to the kda op
        assert f"PASS  {preset} parity" in out
    assert "3 of 6 checks passed" in out


def test_tiny_gradients_are_judged_against_the_floor():
    """A 1e-9 gradient that is off by 50 % is harmless next to 1e-1 gradients;
    the same error on a large gradient fails."""
    tol = DEFAULT_TOLERANCES[torch.float32]
    ref = torch.full((4,), 1e-9)
    floor = 1e-4 * 0.1
    assert compare("tiny", ref * 1.5, ref, tol, floor).ok
    assert compare("tiny", ref * 1.5, ref, tol, floor).tiny
    big = torch.full((4,), 0.1)
    assert not compare("big", big * 1.5, big, tol, floor).ok
    assert not compare("nan", torch.full((4,), float("nan")), big, tol, floor).ok
