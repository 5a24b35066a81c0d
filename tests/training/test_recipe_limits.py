"""What the recipe refuses, and how it handles a used, locked, finished or damaged --output-dir.

One shared 3-step run of the tiny preset (seq-len 32, batch 1, a checkpoint at every step, final/) is the
material: each test works on a copy of it. Every refusal is checked to come before the model is loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from support.recipe_runs import metrics, reset_accelerate

from rewy_hf.training import checkpoint as ckpt
from rewy_hf.training import recipe
from rewy_hf.training.options import RecipeError, build_parser, check_args

TINY = ["--seq-len", "32", "--batch-size", "1", "--warmup-steps", "1", "--save-every", "1", "--no-progress",
        "--max-steps", "3"]


def _main(*argv) -> int:
    return recipe.main([*TINY, *map(str, argv)])


@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    """A finished run: checkpoint-1..3, final/, metrics of steps 1-3."""
    out = tmp_path_factory.mktemp("done") / "run"
    rc = _main("--output-dir", out)
    reset_accelerate()
    assert rc == 0
    assert not (out / ".lock").exists()   # released at the end
    return out


@pytest.fixture
def run_copy(done_run, tmp_path) -> Path:
    return Path(shutil.copytree(done_run, tmp_path / "run"))


@pytest.fixture
def no_model_load(monkeypatch):
    """Makes loading the model fail the test: the refusal must come before it."""
    def boom(args):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(recipe, "load_model_and_tokenizer", boom)


def _refused(capsys, *argv) -> str:
    rc = _main(*argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ")
    return err


def _snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*")) if p.is_file()}


def _losses(out: Path) -> tuple[list[int], list[float]]:
    records = metrics(out)
    return [r["step"] for r in records], [r["loss"] for r in records]


# --- row 1: a used --output-dir, and the run identity --------------------------------------------------

def test_fresh_run_refuses_a_used_output_dir(run_copy, capsys, no_model_load):
    before = _snapshot(run_copy)
    err = _refused(capsys, "--output-dir", run_copy)
    assert str(run_copy) in err and "checkpoint-1" in err
    assert "--resume" in err and "--overwrite-output-dir" in err
    assert _snapshot(run_copy) == before and not (run_copy / ".lock").exists()


def test_overwrite_output_dir_clears_only_the_earlier_run(tmp_path):
    out = tmp_path / "run"
    for d in ("checkpoint-7", ".checkpoint-9.partial", "final"):
        (out / d).mkdir(parents=True)
    ckpt.write_state(out / "checkpoint-7", {"step": 7})
    (out / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    (out / "loss_curve.png").write_bytes(b"old")
    (out / "notes.txt").write_text("mine")
    assert _main("--output-dir", out, "--overwrite-output-dir", "--stop-after", "0") == 0
    assert sorted(p.name for p in out.iterdir()) == ["dispatch_report.json", "metrics.jsonl", "notes.txt",
                                                     "run_config.json"]
    assert (out / "metrics.jsonl").read_text() == "" and (out / "notes.txt").read_text() == "mine"


def test_overwrite_with_resume_is_refused(tmp_path, capsys, no_model_load):
    err = _refused(capsys, "--output-dir", tmp_path, "--resume", "--overwrite-output-dir")
    assert "--overwrite-output-dir" in err and "--resume" in err


def test_resume_compares_the_whole_configuration(done_run, tmp_path, capsys, no_model_load):
    """Settings outside the old hand-picked list count too, and every difference is listed."""
    err = _refused(capsys, "--output-dir", tmp_path / "elsewhere", "--resume", done_run / "checkpoint-2",
                   "--weight-decay", "0.05", "--max-grad-norm", "0.5")
    assert "weight_decay: 0.01 vs 0.05" in err and "max_grad_norm: 1.0 vs 0.5" in err
    assert str(done_run / "checkpoint-2") in err


def test_run_identity_leaves_out_only_resume_logging_and_stopping():
    recorded = {"lr": 1e-3, "max_steps": 3, "output_dir": "a", "log_every": 1, "save_every": 1,
                "keep_checkpoints": 0, "stop_after": None, "no_progress": False, "resume": None}
    now = recorded | {"output_dir": "b", "log_every": 5, "save_every": 2, "keep_checkpoints": 3, "stop_after": 1,
                      "no_progress": True, "resume": "latest", "overwrite_output_dir": False}
    assert ckpt.identity_diff(recorded, now) == []
    assert ckpt.identity_diff(recorded, now | {"max_steps": 4}) == ["max_steps: 3 vs 4"]   # the LR schedule
    assert ckpt.identity_diff(recorded, now | {"policy": "store"}) == ["policy: (not recorded) vs 'store'"]


# --- row 2: out-of-range hyperparameters ---------------------------------------------------------------

@pytest.mark.parametrize("flag, value, allowed", [
    ("--min-lr-ratio", "-0.1", "in [0, 1]"), ("--min-lr-ratio", "1.5", "in [0, 1]"),
    ("--max-grad-norm", "-1", ">= 0"), ("--max-grad-norm", "inf", "finite"), ("--max-grad-norm", "nan", "finite"),
    ("--weight-decay", "-0.01", ">= 0"), ("--weight-decay", "inf", "finite"),
    ("--lr", "inf", "finite number > 0"), ("--lr", "nan", "finite number > 0"),
    ("--log-every", "0", "at least 1"), ("--keep-checkpoints", "-1", "at least 0"),
    ("--lora-r", "0", "at least 1"), ("--lora-alpha", "0", "at least 1"),
    ("--lora-dropout", "1", "in [0, 1)"), ("--lora-dropout", "-0.1", "in [0, 1)"),
])
def test_out_of_range_hyperparameter(tmp_path, capsys, no_model_load, flag, value, allowed):
    err = _refused(capsys, "--output-dir", tmp_path / "out", "--max-steps", "1", flag, value)
    parsed = getattr(build_parser().parse_args([flag, value]), flag[2:].replace("-", "_"))
    assert f"error: {flag} must be" in err and allowed in err and f"got {parsed}" in err


def test_boundary_hyperparameters_are_accepted():
    """0 keeps meaning no clipping / no decay; the ratio's and dropout's closed ends are allowed."""
    parser = build_parser()
    for argv in (["--max-grad-norm", "0", "--weight-decay", "0", "--min-lr-ratio", "0", "--lora-dropout", "0"],
                 ["--min-lr-ratio", "1", "--keep-checkpoints", "0", "--lora-r", "1", "--lora-alpha", "1"]):
        check_args(parser.parse_args(argv))
    with pytest.raises(RecipeError, match="--lr"):
        check_args(parser.parse_args(["--lr", "0"]))


# --- row 3: the lock ------------------------------------------------------------------------------------

def _write_lock(out: Path, pid: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    return lock


def test_a_live_lock_refuses_a_second_run(tmp_path, capsys, no_model_load):
    lock = _write_lock(tmp_path / "run", os.getpid())   # this test's process: alive
    before = lock.read_text()
    err = _refused(capsys, "--output-dir", tmp_path / "run")
    assert f"pid {os.getpid()}" in err and str(lock) in err
    assert lock.read_text() == before   # the other run's lock is left alone


def test_a_stale_lock_is_taken_over(tmp_path, monkeypatch):
    gone = subprocess.Popen(["true"])
    gone.wait()   # reaped: its pid names no process
    lock = _write_lock(tmp_path / "run", gone.pid)
    held = []
    real_load = recipe.load_model_and_tokenizer

    def load_and_look(args):
        held.append(json.loads(lock.read_text())["pid"])
        return real_load(args)

    monkeypatch.setattr(recipe, "load_model_and_tokenizer", load_and_look)
    with pytest.warns(RuntimeWarning, match=f"took over the lock .* of pid {gone.pid}"):
        assert _main("--output-dir", tmp_path / "run", "--stop-after", "0") == 0
    assert held == [os.getpid()]   # held while running
    assert not lock.exists()       # released at the end


# --- row 4: resuming a finished run ---------------------------------------------------------------------

def test_resume_of_a_finished_run_rewrites_nothing(run_copy, capsys, no_model_load):
    before = _snapshot(run_copy)
    assert _main("--output-dir", run_copy, "--resume") == 0
    assert "is complete" in capsys.readouterr().out
    assert _snapshot(run_copy) == before


# --- row 7: damaged checkpoints -------------------------------------------------------------------------

def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep if keep >= 0 else len(data) + keep])


def test_damage_finds_truncated_and_garbled_files(run_copy):
    ck = run_copy / "checkpoint-3"
    assert ckpt.damage(ck) is None
    cases = [("training_state/model.safetensors", lambda p: _truncate(p, -100), "truncated"),
             ("training_state/model.safetensors", lambda p: _truncate(p, 5), "truncated"),
             ("training_state/optimizer.bin", lambda p: _truncate(p, -1000), "truncated"),
             ("training_state/scheduler.bin", lambda p: p.write_bytes(b"junk"), "not a complete torch archive"),
             ("trainer_state.json", lambda p: _truncate(p, 20), "not valid JSON"),
             ("trainer_state.json", lambda p: p.write_text('{"step": 3}'), "incomplete: no tokens_seen, config")]
    for name, spoil, reason in cases:
        copy = Path(shutil.copytree(ck, run_copy / "spoilt"))
        spoil(copy / name)
        path, why = ckpt.damage(copy)
        assert path == copy / name and reason in why, (name, why)
        shutil.rmtree(copy)
    (ck / "training_state" / "optimizer.bin").unlink()
    assert ckpt.damage(ck) == (ck / "training_state", "holds no optimizer state (optimizer*)")


def test_resume_skips_a_damaged_newest_checkpoint(done_run, run_copy, capsys):
    """The newest checkpoint is truncated: warn, resume from the one before, and train the same step 3."""
    shutil.rmtree(run_copy / "final")
    damaged = run_copy / "checkpoint-3" / "training_state" / "model.safetensors"
    _truncate(damaged, -100)
    with pytest.warns(RuntimeWarning, match=f"{damaged}.*truncated"):
        # other logging and checkpoint cadence are not part of the run's identity
        rc = _main("--output-dir", run_copy, "--resume", "--log-every", "2", "--save-every", "3")
    assert rc == 0
    assert f"resumed from {run_copy / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    (steps, losses), (ref_steps, ref_losses) = _losses(run_copy), _losses(done_run)
    assert steps == ref_steps == [1, 2, 3] and losses == pytest.approx(ref_losses, rel=1e-6)
    assert ckpt.damage(run_copy / "checkpoint-3") is None and (run_copy / "final").is_dir()


@pytest.mark.parametrize("name", ["trainer_state.json", "training_state/optimizer.bin"])
def test_a_damaged_named_checkpoint_is_refused(run_copy, capsys, no_model_load, name):
    _truncate(run_copy / "checkpoint-3" / name, 20)
    err = _refused(capsys, "--output-dir", run_copy, "--resume", run_copy / "checkpoint-3")
    assert f"{run_copy / 'checkpoint-3' / name} is damaged" in err
    assert f"--resume {run_copy / 'checkpoint-2'}" in err   # the previous complete one


# --- row 12 (part): an unwritable --output-dir ----------------------------------------------------------

def test_unwritable_output_dir_fails_before_loading(tmp_path, capsys, no_model_load):
    (tmp_path / "a-file").write_text("")
    err = _refused(capsys, "--output-dir", tmp_path / "a-file" / "out")
    assert f"--output-dir {tmp_path / 'a-file' / 'out'}: cannot create it" in err


# --- a run stopped before its first checkpoint ---------------------------------------------------------

def test_a_run_stopped_before_its_first_checkpoint_has_one_way_forward(tmp_path, capsys):
    """Neither a fresh run nor --resume can take up such a directory: both refusals name the same way
    forward, --overwrite-output-dir, and it works (neither sends the user to the other)."""
    out = tmp_path / "run"
    assert _main("--output-dir", out, "--save-every", "2", "--stop-after", "1") == 0
    capsys.readouterr()
    assert not ckpt.list_checkpoints(out) and (out / "metrics.jsonl").is_file()
    before = _snapshot(out)
    fresh = _refused(capsys, "--output-dir", out)
    assert f"--output-dir {out} holds a run that stopped before its first checkpoint" in fresh
    assert "start it again with --overwrite-output-dir" in fresh and "continue it with --resume" not in fresh
    resumed = _refused(capsys, "--output-dir", out, "--resume")
    assert f"--resume: no complete checkpoint in {out}: the run there stopped before its first save" in resumed
    assert "--overwrite-output-dir in place of --resume" in resumed and "run without --resume" not in resumed
    assert _snapshot(out) == before and not (out / ".lock").exists()
    assert _main("--output-dir", out, "--overwrite-output-dir") == 0
    assert _losses(out)[0] == [1, 2, 3] and (out / "final").is_dir()


def test_resume_in_an_empty_output_dir_still_says_to_run_without_it(tmp_path, capsys, no_model_load):
    err = _refused(capsys, "--output-dir", tmp_path / "new", "--resume")
    assert f"--resume: no complete checkpoint in {tmp_path / 'new'}; run without --resume to start fresh" in err


# --- float16 mixed precision on CPU ---------------------------------------------------------------------

@pytest.mark.parametrize("asked", ["flag", "accelerate config"])
def test_float16_mixed_precision_on_cpu_is_refused(asked, tmp_path, capsys, monkeypatch, no_model_load):
    """Accelerate runs no float16 autocast on CPU: a run would be float32 under an fp16 label, so it is
    refused, whether the flag or an accelerate config asks for it."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")     # the CPU even where a GPU is
    if asked == "flag":
        argv = ["--mixed-precision", "float16"]
        named = "--mixed-precision float16 on CPU"
    else:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
        argv = []
        named = "the accelerate config's mixed_precision fp16 on CPU"
    err = _refused(capsys, "--output-dir", tmp_path / "out", *argv)
    assert named in err and "no float16 autocast" in err
    assert "--mixed-precision bfloat16" in err and "--mixed-precision no" in err
    assert not (tmp_path / "out").exists(), "refused before --output-dir is claimed"


# --- models that cannot, or should not, train on CPU ------------------------------------------------------

def test_a_gdn2_hybrid_without_flash_attention_is_refused_with_the_alternatives(tmp_path, capsys, monkeypatch,
                                                                                no_model_load):
    """gdn2-1b-hybrid's attention layers are FLA's, whose constructor raises ImportError without flash-attn
    (CUDA only): refused before the data and the 1 B model are loaded, naming what to install or train."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    err = _refused(capsys, "--output-dir", tmp_path / "out", "--model", "gdn2-1b-hybrid")
    assert "--model gdn2-1b-hybrid: its full-attention layers (3, 7, 11, 15, 19) are FLA's Attention" in err
    assert "needs flash-attn" in err and ("is not installed" in err or "runs on CUDA GPUs only" in err)
    assert "gdn2-1b (the same size, delta-rule layers only)" in err and "qwen3.5-1b" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_large_model_on_cpu_gets_a_warning_with_its_checkpoint_size(tmp_path, capsys, monkeypatch):
    """The warning's sizes are what the run then writes: the threshold is lowered so the tiny preset gets it."""
    from rewy_hf.training import model_setup

    monkeypatch.setattr(model_setup, "CPU_LARGE_PARAMS", 1)
    out = tmp_path / "run"
    assert _main("--output-dir", out, "--keep-checkpoints", "2") == 0
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert "parameters on CPU: expect many seconds per step" in line and "train on a GPU" in line
    assert "2 checkpoint(s) kept with --save-every 1, --max-steps 3 and --keep-checkpoints 2, plus final/" in line
    per, total = (float(x) for x in re.findall(r"about ([\d.]+) MB per checkpoint, ([\d.]+) MB in all", line)[0])
    written = [_dir_bytes(c) for _, c in ckpt.list_checkpoints(out)]
    assert len(written) == 2 and all(per == pytest.approx(b / 1e6, rel=0.05) for b in written), (per, written)
    assert total == pytest.approx((sum(written) + _dir_bytes(out / "final")) / 1e6, rel=0.05)


def test_the_cpu_warning_is_for_the_1b_presets_on_cpu_only():
    import torch

    from rewy_hf.models.gdn2 import GDN2ForCausalLM, gdn2_config
    from rewy_hf.training.model_setup import cpu_size_warning

    args = build_parser().parse_args(["--max-steps", "1000", "--save-every", "500"])
    with torch.device("meta"):
        big, tiny = GDN2ForCausalLM(gdn2_config("1b")), GDN2ForCausalLM(gdn2_config("tiny"))
    warning = cpu_size_warning(big, args, torch.device("cpu"))
    # float32 weights, written twice, and AdamW's two moments: 16 bytes a parameter, about 18.5 GB
    assert "1,159,336,768 parameters on CPU" in warning and "about 18.5 GB per checkpoint" in warning
    assert "2 checkpoint(s) kept" in warning
    assert cpu_size_warning(big, args, torch.device("cuda")) is None
    assert cpu_size_warning(tiny, args, torch.device("cpu")) is None
