"""The `rewy-hf` CLI, the env report (with rewy-hf's settings), options shared by the
commands, and the packaging rule that `kernels/` never installs as a top-level
package (it would shadow Hugging Face's)."""

import importlib.metadata
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rewy_hf import cli, environment, settings
from rewy_hf.environment import PACKAGES, fla_pin

REPO_ROOT = Path(__file__).resolve().parents[2]

ENV_KEYS = (
    "rewy_hf",
    "python",
    "packages",
    "fla_pin",
    "fla_import",
    "cuda",
    "triton_interpret",
    "settings",
    "backends",
    "eager_parts",
)


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "rewy-hf 0.1.0"


def test_env_json(capsys):
    assert cli.main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(ENV_KEYS) <= set(report)
    assert set(PACKAGES) <= set(report["packages"])
    assert report["backends"]["torch"]["usable"] is True
    assert report["backends"]["torch"]["reason"]
    triton = report["backends"]["triton"]
    if report["cuda"]["available"]:
        assert triton["usable"] is True and "all four ops" in triton["reason"]
    else:
        assert triton["usable"] is False and "needs a CUDA device" in triton["reason"]
    qla = report["backends"]["flash_qla"]
    assert qla["reason"]
    if importlib.util.find_spec("flash_qla") is None:
        assert qla == {"usable": False, "reason": "flash-qla is not installed"}
    assert report["fla_pin"]["required"] == "0.6.0"
    assert isinstance(report["cuda"]["available"], bool)


def test_env_text(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "backends:" in out
    assert re.search(r"^  torch +usable: pure PyTorch", out, re.M)
    assert re.search(r"^  flash_qla +(not )?usable: ", out, re.M)
    assert "a patched transformers layer around its core, eagerly:" in out
    assert re.search(r"^  short_conv +\S", out, re.M) and re.search(r"^  forget_gate \S", out, re.M)


def test_env_lists_both_settings_with_their_values(capsys, monkeypatch, tmp_path):
    """The library reads exactly two environment variables; `rewy-hf env` shows each with its
    current value, in the text and in the JSON (on stdout with --json or --json -, or in a file)."""
    assert [s.name for s in settings.SETTINGS] == ["REWY_HF_CHECK_FINITE", "REWY_HF_TEST_FAULT"]
    monkeypatch.setenv("REWY_HF_CHECK_FINITE", "1")
    monkeypatch.delenv("REWY_HF_TEST_FAULT", raising=False)
    assert cli.main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (finite,) = [line for line in lines if "REWY_HF_CHECK_FINITE" in line]
    (fault,) = [line for line in lines if "REWY_HF_TEST_FAULT" in line]
    assert "'1'" in finite and "NaN/Inf" in finite
    assert "unset" in fault and "grad_scale" in fault
    for argv in (["env", "--json"], ["env", "--json", "-"]):
        assert cli.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["settings"]["REWY_HF_CHECK_FINITE"]["value"] == "1"
        assert report["settings"]["REWY_HF_CHECK_FINITE"]["default"] == "0"
        assert report["settings"]["REWY_HF_TEST_FAULT"]["value"] is None
    path = tmp_path / "env.json"
    assert cli.main(["env", "--json", str(path)]) == 0
    assert capsys.readouterr().out == ""
    assert json.loads(path.read_text())["settings"]["REWY_HF_CHECK_FINITE"]["value"] == "1"


def test_a_misspelt_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("REWY_HF_CHECK_FINITE", "yes")
    with pytest.raises(ValueError, match="REWY_HF_CHECK_FINITE='yes' is not understood; set it to 1"):
        settings.check_finite_enabled()
    from rewy_hf.patching.fault import grad_fault

    monkeypatch.setenv("REWY_HF_TEST_FAULT", "grad_scale=lots")
    with pytest.raises(ValueError, match="REWY_HF_TEST_FAULT='grad_scale=lots' is not understood"):
        grad_fault("kda")


def test_unknown_subcommand_returns_2(capsys):
    assert cli.main(["no-such-command"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'no-such-command'" in err
    assert all(name in err for name in cli.COMMANDS), "the full help, listing the real commands"


def test_no_subcommand_returns_2(capsys):
    assert cli.main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_env_says_what_a_patched_layer_runs_around_its_core_eagerly(monkeypatch):
    from rewy_hf.kernels import short_conv

    parts = ("short_conv", "gated_norm", "forget_gate")
    cpu = environment._eager_parts(False, True)
    assert tuple(cpu) == parts and all("(no CUDA device)" in cpu[p] for p in parts)
    assert "restarting at every document" in cpu["short_conv"]
    assert all("FLA could not be imported" in x for x in environment._eager_parts(True, False).values())
    monkeypatch.setattr(short_conv, "fla_gluon_conv", lambda: object())
    gluon = environment._eager_parts(True, True)
    assert gluon["short_conv"].startswith("FLA's Gluon kernels wherever") and "rms_norm_gated" in gluon["gated_norm"]
    monkeypatch.setattr(short_conv, "fla_gluon_conv", lambda: None)
    assert environment._eager_parts(True, True)["short_conv"].startswith("FLA's Triton kernels (FLA's Gluon")
    assert "not checked" in environment._eager_parts(True, None)["short_conv"]

    def broken():
        raise ImportError("cannot import name 'GluonBackend' from 'fla.backends'")

    monkeypatch.setattr(short_conv, "fla_gluon_conv", broken)
    assert "checking FLA's Gluon kernels failed (ImportError: cannot import name 'GluonBackend'" in \
        environment._eager_parts(True, True)["short_conv"]


def test_fla_pin_mismatch_is_reported():
    assert fla_pin("0.6.0", "0.6.0")["ok"] is True
    bad = fla_pin("0.7.0", "0.6.0")
    assert bad["ok"] is False and "does NOT match" in bad["message"]
    assert "flash-linear-attention 0.7.0" in bad["message"]
    missing = fla_pin(None, None)
    assert missing["ok"] is False and "not installed" in missing["message"]


def test_collect_env_silences_fla_platform_warning(monkeypatch):
    # FLA warns only on its first import, which has usually happened already;
    # stand in for that import so the check does not depend on test order.
    def fake_import(name):
        warnings.warn("Triton is not supported on current platform, roll back to CPU.", UserWarning)

    monkeypatch.setattr(environment.importlib, "import_module", fake_import)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = environment.collect_env()
    assert report["fla_import"]["ok"] is True
    assert not [w for w in caught if "Triton is not supported" in str(w.message)]


@pytest.fixture(scope="module")
def installed_specs(tmp_path_factory):
    """Where a fresh interpreter finds each name, as origin + search paths.

    `python -m pytest` run from the repo root puts the root on sys.path, which
    makes the source folder importable as `kernels` however we package it.
    What the installation provides is what matters, so look from a neutral
    cwd (one subprocess: importing rewy_hf pulls in torch and FLA).
    """
    names = ["kernels", "adapters", "rewy_hf.kernels", "rewy_hf.adapters"]
    code = (
        "import importlib.util, json, sys\n"
        "out = {}\n"
        f"for name in {names!r}:\n"
        "    s = importlib.util.find_spec(name)\n"
        "    out[name] = [] if s is None else "
        "[p for p in [s.origin, *(s.submodule_search_locations or [])] if p]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path_factory.mktemp("neutral_cwd"),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _is_within(location, folder):
    path = Path(location).resolve()
    return path == folder or folder in path.parents


def test_no_top_level_kernels_or_adapters_installed(installed_specs):
    for name in ("kernels", "adapters"):
        # Hugging Face's `kernels` may be installed; it just must not be ours.
        ours = REPO_ROOT / name
        locations = installed_specs[name]
        assert not any(_is_within(loc, ours) for loc in locations), (name, locations)
    top_level = importlib.metadata.distribution("rewy-hf").read_text("top_level.txt")
    if top_level is not None:  # setuptools writes it; other backends may not
        assert top_level.split() == ["rewy_hf"]


def test_kernels_and_adapters_installed_under_rewy_hf(installed_specs):
    for name in ("kernels", "adapters"):
        locations = installed_specs[f"rewy_hf.{name}"]
        assert locations, name
        assert any(Path(loc).resolve().parent.name == name for loc in locations), locations
