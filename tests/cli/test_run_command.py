"""`rewy-hf run`: an unmodified training script, every model patched as it is
created (through a PreTrainedModel.post_init hook), a JSON report, and the
exit-status contract (script failure > no optimized backward (3) > 0)."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

import rewy_hf
from rewy_hf import cli
from rewy_hf.cli.run import EXIT_NO_BACKWARD
from rewy_hf.patching.model_creation import ModelRecorder, post_init_hook

SCRIPTS = Path(__file__).resolve().parents[1] / "support" / "scripts"
TRAIN = str(SCRIPTS / "train_tiny_qwen35.py")
FAIL = str(SCRIPTS / "fail.py")
INSPECT = str(SCRIPTS / "inspect_run.py")


@pytest.fixture(autouse=True)
def _post_init_untouched():
    """Every test must leave PreTrainedModel.post_init exactly as it found it."""
    before = PreTrainedModel.__dict__["post_init"]
    yield
    assert PreTrainedModel.__dict__["post_init"] is before


def _tiny_models():
    spec = importlib.util.spec_from_file_location("_rewy_test_tiny_models", SCRIPTS / "_tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*argv):
    return cli.main(["run", *map(str, argv)])


def _load(path):
    return json.loads(Path(path).read_text())


def _check_trained_report(report, steps=2, policy="recompute", backend="auto"):
    assert report["core"] == "rewy" and report["backend"] == backend and report["policy"] == policy
    assert report["exit_status"] == 0 and report["error"] is None
    assert report["models_created"] == ["Qwen3_5ForCausalLM"]  # the inner Qwen3_5TextModel is folded in
    (model,) = report["patched_models"]
    assert model["model"] == "Qwen3_5ForCausalLM"
    assert [(p["name"], p["op"], p["already"]) for p in model["patched"]] == [
        ("model.layers.0.linear_attn", "gated_delta_rule", False)]
    gdr = report["dispatch"]["ops"]["gated_delta_rule"]
    assert gdr["forward_calls"] == steps
    assert gdr["optimized_backward_calls"] == steps
    assert gdr["fallback_calls"] == 0
    assert gdr["policies"] == {policy: steps}


def test_train_in_process(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _run("--json", out, TRAIN, "--steps", 2) == 0
    report = _load(out)
    _check_trained_report(report)
    assert report["script"] == TRAIN and report["argv"] == ["--steps", "2"]
    captured = capsys.readouterr()
    assert "step 1: loss" in captured.out                       # the script's own output
    assert "gated_delta_rule" in captured.err and "1 patched" in captured.err  # the summary
    # Counts are this run's only, however many ran in this process before.
    assert _run("--json", out, TRAIN, "--steps", 1) == 0
    assert _load(out)["dispatch"]["ops"]["gated_delta_rule"]["optimized_backward_calls"] == 1


def test_policy_and_fallback_are_passed_through(tmp_path):
    out = tmp_path / "r.json"
    assert _run("--policy", "full", "--fallback", "original", "--json", out, TRAIN, "--steps", 1) == 0
    report = _load(out)
    _check_trained_report(report, steps=1, policy="full")
    assert report["fallback"] == "original" and report["patched_models"][0]["fallback"] == "original"


def test_json_can_go_to_stdout(capsys):
    """--json - puts the report on stdout after the script's own output (the summary stays on stderr)."""
    assert _run("--backend", "torch", "--json", "-", TRAIN, "--steps", 1) == 0
    out = capsys.readouterr().out
    start = re.search(r"^\{$", out, re.MULTILINE).start()
    assert "step 0: loss" in out[:start]
    report = json.loads(out[start:])
    _check_trained_report(report, steps=1, backend="torch")
    assert report["dispatch"]["ops"]["gated_delta_rule"]["backends"] == {"torch": 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusal")
def test_backend_reaches_the_patched_layers(tmp_path, capsys):
    """--backend means rewy's backend here as everywhere: triton on CPU patches the layers for
    triton, and their first call refuses by name."""
    out = tmp_path / "r.json"
    assert _run("--backend", "triton", "--json", out, TRAIN, "--steps", 1) == 1
    report = _load(out)
    assert report["patched_models"][0]["patched"][0]["backend"] == "triton"
    assert "`backend`='triton' needs CUDA tensors" in report["error"]


def test_train_console_script(tmp_path):
    exe = shutil.which("rewy-hf") or str(Path(sys.executable).with_name("rewy-hf"))
    out = tmp_path / "r.json"
    proc = subprocess.run([exe, "run", "--json", str(out), TRAIN, "--steps", "2"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: loss" in proc.stdout
    assert "optimized backward" in proc.stderr
    _check_trained_report(_load(out))


def test_forward_only_exits_3_unless_allowed(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _run("--json", out, TRAIN, "--steps", 1, "--forward-only") == EXIT_NO_BACKWARD == 3
    err = capsys.readouterr().err
    assert "no optimized backward ran" in err and "--allow-no-backward" in err
    report = _load(out)
    assert report["exit_status"] == 3 and report["script_exit_status"] == 0
    assert report["dispatch"]["ops"]["gated_delta_rule"]["forward_calls"] == 1
    assert report["dispatch"]["ops"]["gated_delta_rule"]["optimized_backward_calls"] == 0

    assert _run("--allow-no-backward", "--json", out, TRAIN, "--steps", 1, "--forward-only") == 0
    assert _load(out)["exit_status"] == 0


def test_no_model_at_all_exits_3(tmp_path, capsys):
    assert _run(INSPECT, tmp_path / "i.json") == 3
    assert "created no transformers/FLA model" in capsys.readouterr().err


def test_script_that_raises(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _run("--json", out, FAIL, "--mode", "raise", "--build-model") == 1
    report = _load(out)
    assert report["exit_status"] == report["script_exit_status"] == 1
    assert "Traceback" in report["error"] and "RuntimeError: boom from the training script" in report["error"]
    assert report["patched_models"][0]["model"] == "Qwen3_5ForCausalLM"  # patched before it failed
    err = capsys.readouterr().err
    assert "boom from the training script" in err
    assert "no optimized backward ran" not in err   # the script's failure wins over the backward check


def test_script_that_calls_sys_exit(tmp_path):
    out = tmp_path / "r.json"
    assert _run("--json", out, FAIL, "--mode", "exit", "--code", 5) == 5
    report = _load(out)
    assert report["exit_status"] == 5 and report["error"] == "SystemExit(5)"


def test_core_original_patches_nothing(tmp_path, capsys):
    # Builds a Qwen3.5 but runs no forward: unpatched, its delta-rule core
    # would call FLA's Triton op, which has no CPU driver.
    out, seen = tmp_path / "r.json", tmp_path / "i.json"
    assert _run("--core", "original", "--json", out, INSPECT, seen, "--model", "qwen35") == 0
    assert _load(seen)["patched_layers"] == 0
    report = _load(out)
    assert report["core"] == "original" and report["exit_status"] == 0
    assert report["patched_models"] == [] and report["dispatch"] == {"ops": {}}
    assert report["models_created"] == ["Qwen3_5ForCausalLM"]
    assert "none patched (core=original)" in capsys.readouterr().err


def test_optimized_patches_at_creation(tmp_path):
    seen = tmp_path / "i.json"
    assert _run("--allow-no-backward", INSPECT, seen, "--model", "qwen35") == 0
    assert _load(seen)["patched_layers"] == 1      # already patched when the constructor returned


def test_model_without_delta_rule_layers(tmp_path):
    out, seen = tmp_path / "r.json", tmp_path / "i.json"
    assert _run("--allow-no-backward", "--json", out, INSPECT, seen, "--model", "llama") == 0
    report = _load(out)
    assert report["models_created"] == ["LlamaForCausalLM"] and report["patched_models"] == []


def test_script_sees_main_argv_and_path(tmp_path):
    seen = tmp_path / "i.json"
    argv_before, path_before = sys.argv[:], sys.path[:]
    # Options after the script, even ones `run` itself has, belong to the script.
    assert _run("--core", "original", INSPECT, seen, "--json", "x", "--steps", "3") == 0
    info = _load(seen)
    assert info["name"] == "__main__"
    assert info["argv"] == [INSPECT, str(seen), "--json", "x", "--steps", "3"]
    assert info["path0"] == str(SCRIPTS)
    assert info["post_init_hooked"] is True
    assert sys.argv == argv_before and sys.path == path_before
    assert not hasattr(PreTrainedModel.post_init, "_rewy_run_hook")


def test_post_init_restored_after_error(tmp_path):
    original = PreTrainedModel.__dict__["post_init"]
    assert _run(FAIL, "--mode", "raise") == 1
    assert PreTrainedModel.__dict__["post_init"] is original

    def broken_callback(model):
        raise ValueError("hook failed")

    with pytest.raises(ValueError, match="hook failed"):
        with post_init_hook(broken_callback):
            assert PreTrainedModel.post_init is not original
            _tiny_models().tiny_llama()
    assert PreTrainedModel.__dict__["post_init"] is original


def test_layers_patched_by_the_run_are_restored(tmp_path):
    # The run leaves the process as it found it: dispatch counts aside, no
    # layer stays routed to rewy once the script is over.
    recorder = ModelRecorder({"backend": "auto", "policy": "recompute", "fallback": "error"})
    with post_init_hook(recorder):
        model = _tiny_models().tiny_qwen35()
    assert sum(rewy_hf.is_patched(m) for m in model.modules()) == 1
    assert recorder.unpatch() == 1
    assert not any(rewy_hf.is_patched(m) for m in model.modules())


def test_missing_script(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _run("--json", out, tmp_path / "nope.py") == 2
    assert "can't open file" in capsys.readouterr().err
    assert _load(out)["exit_status"] == 2
