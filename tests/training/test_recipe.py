"""recipes/finetune_gdn2.py on CPU: the tiny GDN2 preset, seq-len 80 (more than one 64-token chunk), batch 2.

Training steps dominate the time (the Triton interpreter runs FLA's short convolution at several seconds a
step), so the runs are shared: one uninterrupted 5-step run (checkpoints at 3 and, as the last step, 5) is
the reference; a second run resumes from a copy of its step-3 checkpoint and must reproduce steps 4-5 (the
second of them taken with the restored optimizer moments); one 1-step LoRA run goes through the script entry
in a subprocess. Everything else fails before training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.recipe_runs import metrics, reset_accelerate

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "finetune_gdn2.py"
COMMON = ["--seq-len", "80", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "2", "--no-progress"]


def _recipe_main():
    spec = importlib.util.spec_from_file_location("finetune_gdn2_recipe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # the script's `if __name__ == "__main__"` does not fire
    return lambda argv: module.main(argv, default_model="gdn2-tiny")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted reference: 5 steps, checkpoints at 3 and 5."""
    out = tmp_path_factory.mktemp("full")
    rc = _recipe_main()([*COMMON, "--max-steps", "5", "--save-every", "3", "--output-dir", str(out)])
    reset_accelerate()
    assert rc == 0
    return out


def test_full_run_outputs(full_run):
    from rewy_hf.training.checkpoint import list_checkpoints

    records = metrics(full_run)
    assert [r["step"] for r in records] == list(range(1, 6))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(r)
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ("loss", "lr", "grad_norm"))
    assert records[-1]["loss"] < records[0]["loss"]
    # warmup (2 steps) then cosine decay to 10% of --lr
    lrs = [r["lr"] for r in records]
    assert lrs[0] == pytest.approx(1.5e-3) and lrs[1] == pytest.approx(3e-3) and lrs[2] == pytest.approx(3e-3)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))

    assert [s for s, _ in list_checkpoints(full_run)] == [3, 5]
    assert not [p for p in full_run.iterdir() if p.name.startswith(".")]   # no partial leftovers
    ck = full_run / "checkpoint-3"
    assert (ck / "model.safetensors").is_file() and (ck / "config.json").is_file()
    assert (ck / "byte_tokenizer.json").is_file()
    assert any(p.suffix == ".safetensors" for p in (ck / "training_state").iterdir())
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == 3

    assert (full_run / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((full_run / "dispatch_report.json").read_text())
    assert len(report["patch_report"]["patched"]) == 2
    gdn2 = report["dispatch"]["ops"]["gdn2"]
    assert gdn2["optimized_backward_calls"] == 5 * 2 and gdn2["fallback_calls"] == 0


def test_saved_model_reloads(full_run):
    import rewy_hf.models.gdn2  # noqa: F401  (registers "gdn2")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import rewy_hf

    for d in (full_run / "checkpoint-5", full_run / "final"):
        model = AutoModelForCausalLM.from_pretrained(d)
        assert model.config.model_type == "gdn2"
        saved = load_file(d / "model.safetensors")
        state = model.state_dict()
        for k, v in saved.items():
            assert torch.equal(state[k], v), k
    rewy_hf.patch_model(model)   # on CPU FLA's chunk kernel can't run unpatched
    with torch.no_grad():
        logits = model(input_ids=torch.arange(70).view(1, 70)).logits
    assert logits.shape == (1, 70, model.config.vocab_size) and torch.isfinite(logits).all()


def test_resume_reproduces_uninterrupted_losses(full_run, tmp_path, capsys):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full_run / "checkpoint-3", out / "checkpoint-3")
    # The interrupted run had logged steps 4-5 before dying: resume must drop them and re-log.
    shutil.copy(full_run / "metrics.jsonl", out / "metrics.jsonl")
    (out / ".checkpoint-5.partial").mkdir()   # a half-written checkpoint must be ignored
    rc = _recipe_main()([*COMMON, "--max-steps", "5", "--save-every", "3", "--output-dir", str(out), "--resume"])
    assert rc == 0
    # it continued from the checkpoint (a run retrained from step 1 would log the same losses here)
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in capsys.readouterr().out
    ref, got = metrics(full_run), metrics(out)
    assert [r["step"] for r in got] == list(range(1, 6))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), a["step"]
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert (out / "checkpoint-5" / "trainer_state.json").is_file()
    # the summary's losses are the whole run's, its steps and tokens this process's
    summary = json.loads((out / "run_config.json").read_text())["summary"]
    losses = [r["loss"] for r in got]
    assert (summary["final_step"], summary["final_loss"]) == (5, losses[-1])
    assert summary["best_loss"] == min(losses) and losses[summary["best_step"] - 1] == min(losses)
    assert (summary["steps_run"], summary["first_step_run"], summary["last_step_run"]) == (2, 4, 5)
    assert summary["tokens"] == 2 * 2 * 80
    assert summary["step_time_s"] == pytest.approx(sum(r["step_time_s"] for r in got[3:]), rel=1e-9)


def test_resume_refuses_changed_settings(full_run, tmp_path, capsys):
    rc = _recipe_main()([*COMMON, "--seq-len", "96", "--max-steps", "5", "--output-dir", str(tmp_path),
                         "--resume", str(full_run / "checkpoint-3")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "seq_len: 80 vs 96" in err
    assert "resume with the checkpoint's settings, or start a new run in another --output-dir" in err


def test_lora_script_entry(tmp_path):
    """The script itself (subprocess), with --lora: only adapters train; the merged model reloads.
    One step of one sequence is enough for that (the adapters' update changes the merged weights)."""
    out = tmp_path / "lora"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--lora", "--lora-r", "4", *COMMON, "--batch-size", "1",
                           "--max-steps", "1", "--save-every", "0", "--output-dir", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final model:" in proc.stdout and str(out) in proc.stdout
    # which backend served the cores is said (on a GPU it must read triton, not torch)
    assert re.search(r"delta-rule cores: \w+: torch [1-9]\d* \(rank 0\)", proc.stdout), proc.stdout[-2000:]

    cfg = json.loads((out / "run_config.json").read_text())
    assert 0 < cfg["trainable_params"] < cfg["total_params"] // 5
    assert (out / "final-adapter" / "adapter_model.safetensors").is_file()
    targets = json.loads((out / "final-adapter" / "adapter_config.json").read_text())["target_modules"]
    assert set(targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    import rewy_hf.models.gdn2  # noqa: F401
    from transformers import AutoModelForCausalLM

    from rewy_hf.training.model_setup import load_model_and_tokenizer
    from rewy_hf.training.options import build_parser

    merged = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    base, _, _ = load_model_and_tokenizer(build_parser().parse_args([]))   # same seed -> the initial weights
    base = base.state_dict()
    assert set(merged) == set(base)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed, "LoRA training changed nothing"
    assert all(k.rsplit(".", 2)[-2] in targets for k in changed), sorted(changed)
    assert "model.embeddings.weight" not in changed and "lm_head.weight" not in changed


def test_stop_after_leaves_a_resumable_run(tmp_path, capsys):
    """--stop-after 0: nothing trained, no final model, and the summary says how to continue."""
    rc = _recipe_main()([*COMMON, "--max-steps", "4", "--stop-after", "0", "--output-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "continue with --resume" in out
    assert "final loss:       none (no step logged)" in out and "tokens/s:         none (no training step)" in out
    assert not (tmp_path / "final").exists() and (tmp_path / "metrics.jsonl").read_text() == ""


# --- bad input: clear message, exit code 2, before any training ----------------------------------

def _bad(tmp_path, capsys, *argv) -> str:
    rc = _recipe_main()([*COMMON, "--max-steps", "1", "--output-dir", str(tmp_path / "out"), *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    return err


def test_missing_data_file(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "--data", str(tmp_path / "nope.txt"))
    assert "data file not found" in err and "--data" in err


def test_empty_data_file(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("  \n")
    err = _bad(tmp_path, capsys, "--data", str(tmp_path / "empty.txt"))
    assert "is empty (no text); pass --data with a non-empty" in err


def test_seq_len_longer_than_data(tmp_path, capsys):
    (tmp_path / "short.jsonl").write_text('{"text": "only a few bytes"}\n')
    err = _bad(tmp_path, capsys, "--data", str(tmp_path / "short.jsonl"))
    assert "fewer than one training window" in err and "--seq-len 16 or less" in err


@pytest.mark.parametrize("model, hint", [("gdn2-huge", "gdn2-tiny"), ("no-such-preset", "tiny-qwen3.5")])
def test_unknown_preset(tmp_path, capsys, model, hint):
    err = _bad(tmp_path, capsys, "--model", model)
    assert "unknown" in err and model in err and hint in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusal")
def test_original_core_needs_gpu(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "--core", "original")
    assert "GPU" in err and "--core rewy" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusal")
def test_triton_backend_needs_gpu(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "--backend", "triton")
    assert "--backend triton needs a CUDA GPU" in err and "--backend auto" in err


def test_options_speak_the_commands_words(capsys):
    """--backend is rewy's backend (auto|torch|triton) as in every rewy-hf command, --core picks
    rewy's core or the model's own, dtypes are spelt as torch spells them, and --help shows defaults."""
    from rewy_hf.training.options import accelerate_mixed_precision, build_parser

    parser = build_parser()
    args = parser.parse_args([])
    assert (args.core, args.backend, args.mixed_precision) == ("rewy", "auto", "auto")
    assert parser.parse_args(["--backend", "torch", "--core", "original"]).backend == "torch"
    for old in (["--backend", "optimized"], ["--kernels", "auto"], ["--mixed-precision", "bf16"]):
        with pytest.raises(SystemExit):
            parser.parse_args(old)
        err = capsys.readouterr().err
        assert (f"argument {old[0]}: invalid choice: '{old[1]}'" in err
                or f"unrecognized arguments: {' '.join(old)}" in err), err
    assert accelerate_mixed_precision("bfloat16") == "bf16" and accelerate_mixed_precision("float16") == "fp16"
    assert accelerate_mixed_precision("no") == "no"
    text = parser.format_help()
    assert "(default: rewy)" in text and "(default: auto)" in text and "(default: 512)" in text


def test_resume_without_checkpoint(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "--resume")
    assert f"--resume: no complete checkpoint in {tmp_path / 'out'}; run without --resume to start fresh" in err


# --- the pieces ----------------------------------------------------------------------------------

def test_data_pieces(tmp_path):
    from rewy_hf.training.data import ByteTokenizer, DataError, WindowSampler, pack, read_documents

    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    docs = read_documents(str(ROOT / "recipes" / "data" / "sample.jsonl"))
    assert len(docs) == 6
    windows = pack(docs, tok, 63)
    assert windows.shape[1] == 64 and (windows == tok.eos_token_id).sum() >= 5
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(DataError, match="line 1"):
        read_documents(str(tmp_path / "bad.jsonl"))
    # binary data and other encodings are refused, not decoded into replacement characters
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 16)
    with pytest.raises(DataError, match="blob.txt is binary data, not text"):
        read_documents(str(tmp_path / "blob.txt"))
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl is not UTF-8 text \(byte 13"):
        read_documents(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "nul.txt").write_bytes(b"some text\0more")
    with pytest.raises(DataError, match="NUL bytes"):
        read_documents(str(tmp_path / "nul.txt"))
    from importlib import resources

    from rewy_hf.training.options import BUNDLED_CORPUS

    # shipped inside the package, so the default --data works from any install
    corpus = resources.files("rewy_hf.training").joinpath("corpus.txt").read_text(encoding="utf-8")
    assert 30_000 < len(corpus.encode()) < 60_000
    assert BUNDLED_CORPUS.read_text(encoding="utf-8") == corpus

    a = [WindowSampler(10, 3, world_size=2, rank=r, seed=1) for r in (0, 1)]
    first_epoch = a[0].indices(0) + a[1].indices(0) + a[0].indices(1)[:1]
    assert len(set(first_epoch)) == 7   # ranks draw disjoint windows
    assert a[0].indices(5) == WindowSampler(10, 3, 2, 0, seed=1).indices(5)   # a pure function of position


def test_schedule_and_checkpoint_discovery(tmp_path):
    from rewy_hf.training import checkpoint as ckpt
    from rewy_hf.training.schedule import warmup_cosine

    assert [warmup_cosine(s, 4, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(12, 4, 20, 0.0) == pytest.approx(0.5)

    for step, complete in ((3, True), (7, False), (5, True)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:
            ckpt.write_state(d, {"step": step})
    (tmp_path / ".checkpoint-9.partial").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-5"
    part = tmp_path / ".checkpoint-9.partial"
    ckpt.write_state(part, {"step": 9})
    ckpt.commit(part, tmp_path / "checkpoint-9")
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-9" and not part.exists()
    ckpt.prune(tmp_path, keep=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [9]


def test_compile_choice_says_why(monkeypatch):
    from rewy_hf.training.options import compile_choice

    assert compile_choice("on") == (True, "--compile on") and compile_choice("off") == (False, "--compile off")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compile_choice("auto") == (False, "--compile auto: off on CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on, why = compile_choice("auto")
    # the figures it quotes are those of the published runs (docs/bench/model, docs/performance.md)
    model = Path(__file__).resolve().parents[2] / "docs" / "bench" / "model"
    sides = lambda name: json.loads((model / f"compile-{name}.json").read_text())["sides"]  # noqa: E731
    qwen, kimi, kimi_compiled = sides("qwen3.5-gva-1b-corpus"), sides("kimi-linear-1b-corpus"), \
        sides("kimi-linear-1b-corpus-compiled")
    step = lambda s, side: s[side]["median_step_ms"]  # noqa: E731
    vs_eager = sorted([step(qwen, "unpatched eager") / step(qwen, "patched compiled"),
                       step(kimi, "unpatched eager") / step(kimi_compiled, "patched compiled")])
    vs_compiled = sorted([step(qwen, "unpatched compiled") / step(qwen, "patched compiled"),
                          step(kimi_compiled, "unpatched compiled") / step(kimi_compiled, "patched compiled")])
    assert on and "--compile off" in why
    assert f"{vs_eager[0]:.2f}-{vs_eager[1]:.2f}x as fast per step as unpatched eager" in why, (vs_eager, why)
    assert f"{vs_compiled[0]:.2f}-{vs_compiled[1]:.2f}x as fast as unpatched compiled" in why, (vs_compiled, why)


def test_training_step_builds_no_cache(tmp_path, monkeypatch):
    """A transformers preset's config says use_cache; the recipe's training forward must not build a
    cache anyway (state writes every layer, and a recompile trigger under torch.compile)."""
    from transformers import cache_utils

    from rewy_hf.training import recipe

    built = []
    init = cache_utils.DynamicCache.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", counting_init)
    rc = recipe.main(["--model", "tiny-qwen3.5", *COMMON, "--max-steps", "1", "--save-every", "0",
                      "--output-dir", str(tmp_path / "run")])
    assert rc == 0 and built == []


def test_no_cache_argument_only_where_the_forward_takes_it():
    from peft import LoraConfig, get_peft_model

    from rewy_hf.models.presets import build_preset
    from rewy_hf.training.loop import no_cache_kwargs

    class NoCacheArgument(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    assert no_cache_kwargs(NoCacheArgument()) == {}
    qwen = build_preset("tiny-qwen3.5")
    assert no_cache_kwargs(qwen) == {"use_cache": False}
    assert no_cache_kwargs(get_peft_model(qwen, LoraConfig(r=2, target_modules=["q_proj"]))) == {"use_cache": False}


def test_a_model_without_a_tokenizer_trains_on_byte_ids_and_says_so(tmp_path, capsys):
    """A model directory without tokenizer files gets the byte tokenizer, whose special-token ids
    replace the model's in its config, and the run says so (one whose tokenizer fails to load is
    refused instead: tests/parity/test_parity_command.py)."""
    from types import SimpleNamespace

    from rewy_hf.models.presets import build_preset
    from rewy_hf.training.data import ByteTokenizer
    from rewy_hf.training.model_setup import load_model_and_tokenizer

    build_preset("tiny-qwen3.5").save_pretrained(tmp_path / "no_tokenizer")
    args = SimpleNamespace(model=str(tmp_path / "no_tokenizer"), revision=None, trust_remote_code=False, seed=0)
    model, tok, source = load_model_and_tokenizer(args)
    assert isinstance(tok, ByteTokenizer) and source == "local"
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert model.get_input_embeddings().num_embeddings >= len(tok)
    err = capsys.readouterr().err
    assert f"note: {tmp_path / 'no_tokenizer'} has no tokenizer files; training on byte ids" in err
