"""`rewy-hf parity` end to end on CPU: local directories, an offline hub cache,
a deliberately broken core, models it cannot serve, and the presets."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import pytest

from rewy_hf.cli import main
from rewy_hf.models.presets import build_preset

QUICK = ["--steps", "1", "--batch-size", "1", "--seq-len", "80"]


def _run(argv, capsys):
    code = main(["parity", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def saved_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen")
    build_preset("tiny-qwen3.5").save_pretrained(path)
    return path


def test_local_directory_parity_holds(saved_qwen, tmp_path, capsys):
    report = tmp_path / "parity.json"
    code, out, _ = _run(["--model", str(saved_qwen), "--json", str(report), *QUICK], capsys)
    assert code == 0, out
    assert "PARITY HOLDS" in out
    data = json.loads(report.read_text())
    assert data["ok"] is True and data["exit_code"] == 0
    assert data["loss_rel_err"] <= data["tolerance"]["loss_rel"]
    assert data["optimized_backward_calls"] == 1
    names = {g["name"] for g in data["gradients"]}
    assert "model.layers.0.linear_attn.A_log" in names and "lm_head.weight" in names
    assert all(g["rel_err"] <= data["tolerance"]["grad_rel"] for g in data["gradients"])
    assert [p["name"] for p in data["patch_report"]["patched"]] == ["model.layers.0.linear_attn"]
    assert data["update"], "the optimizer-step comparison is on by default"
    (norms,) = data["grad_norm"]
    assert norms["unpatched"] > 0 and norms["rel_diff"] <= data["tolerance"]["grad_rel"]
    assert "gradient norm     unpatched" in out


def test_hub_id_from_offline_cache(saved_qwen, tmp_path):
    """A hand-built Hugging Face cache: models--org--name/snapshots/<rev>/ + refs/main.
    Run in a subprocess: huggingface_hub reads HF_HUB_OFFLINE and the cache path at import."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--rewy-test--tiny-qwen"
    shutil.copytree(saved_qwen, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([shutil.which("rewy-hf"), "parity", "--model", "rewy-test/tiny-qwen", *QUICK],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY HOLDS" in proc.stdout


def test_broken_core_fails_and_names_layers(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REWY_HF_TEST_FAULT", "grad_scale=1.05")
    report = tmp_path / "parity.json"
    with pytest.warns(RuntimeWarning, match="deliberately corrupting"):
        code, out, _ = _run(["--model", "tiny-qwen3.5", "--json", str(report), *QUICK], capsys)
    assert code == 1
    assert "PARITY VIOLATED" in out and "model.layers.0" in out
    data = json.loads(report.read_text())
    bad = {g["name"] for g in data["gradients"] if g["rel_err"] > data["tolerance"]["grad_rel"]}
    assert "model.layers.0.linear_attn.A_log" in bad
    assert not any(name.startswith("lm_head") for name in bad), "upstream-only parameters are unaffected"
    (norms,) = data["grad_norm"]
    # a correct core leaves the global gradient norm within about 1e-8 (float32 rounding); one layer's
    # gradients scaled by 1.05 move it by about 1e-3
    assert norms["rel_diff"] > 1e-5, "the corrupted core's gradients reach the global norm"


@pytest.mark.parametrize("fault", [None, "grad_scale=1.06"])   # a spec of its own: each warns once
def test_compiled_parity_compiles_both_sides_and_still_catches_a_broken_core(fault, tmp_path, capsys, monkeypatch):
    """--compile: both sides run through torch.compile (graphs are made for both), the comparison
    holds for rewy's core, and a corrupted core gradient still fails it."""
    import torch

    if fault:
        monkeypatch.setenv("REWY_HF_TEST_FAULT", fault)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    report = tmp_path / "parity.json"
    with pytest.warns(RuntimeWarning, match="deliberately corrupting") if fault else contextlib.nullcontext():
        code, out, _ = _run(["--model", "tiny-qwen3.5", "--compile", "aot_eager", "--json", str(report), *QUICK],
                            capsys)
    data = json.loads(report.read_text())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs >= 2, "both sides were compiled"
    assert data["compile"] == "aot_eager" and "both sides compiled (aot_eager)" in out
    assert data["optimized_backward_calls"] == 1
    if fault:
        assert code == 1 and "PARITY VIOLATED" in out
        bad = {g["name"] for g in data["gradients"] if g["rel_err"] > data["tolerance"]["grad_rel"]}
        assert "model.layers.0.linear_attn.A_log" in bad
    else:
        assert code == 0, out
        assert all(g["rel_err"] <= data["tolerance"]["grad_rel"] for g in data["gradients"])


def test_model_without_delta_rule_layer_exits_2(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(path)
    code, _, err = _run(["--model", str(path), *QUICK], capsys)
    assert code == 2
    assert "no supported delta-rule layer found in LlamaForCausalLM" in err


def test_missing_model_exits_2_with_loader_reason(tmp_path):
    """HF_HUB_OFFLINE=1 in the environment alone (read by huggingface_hub at import) is enough."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([shutil.which("rewy-hf"), "parity", "--model", "no-such-org/no-such-model", *QUICK],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2
    assert ("model 'no-such-org/no-such-model' is not a preset, not a local directory and not in the local "
            "Hugging Face cache") in proc.stderr
    assert "HF_HUB_OFFLINE=1 forbids downloading" in proc.stderr and "tiny-qwen3.5" in proc.stderr


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup fails (and is counted): nothing here may reach a network."""
    import socket

    lookups = []

    def lookup(host, *args, **kwargs):
        lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, f"simulated: no network (looking up {host})")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    return lookups


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_offline_hub_id_not_in_the_cache_fails_at_once(empty_hub_cache, no_network, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    report = tmp_path / "parity.json"
    code, _, err = _run(["--model", "no-such-org/no-such-model", "--json", str(report), *QUICK], capsys)
    assert code == 2
    assert ("could not run: model 'no-such-org/no-such-model' is not a preset, not a local directory and not in "
            "the local Hugging Face cache") in err
    assert "HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE" in err and "tiny-qwen3.5" in err
    assert str(empty_hub_cache) in err, "names the cache it looked in"
    assert no_network == [], "no request is made offline"
    assert json.loads(report.read_text())["exit_code"] == 2


def test_unreachable_hub_fails_after_one_try(empty_hub_cache, no_network, monkeypatch):
    """Not offline, not cached, and the hub cannot be reached: one request, no retries and no backing
    off (a sleep would fail the test)."""
    import time

    from huggingface_hub import constants

    from rewy_hf.models.loading import ModelLoadError, load_causal_lm

    def no_sleep(seconds):
        raise AssertionError(f"backed off for {seconds} s before failing")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(time, "sleep", no_sleep)
    with pytest.raises(ModelLoadError) as info:
        load_causal_lm("no-such-org/no-such-model")
    message = str(info.value)
    assert "'no-such-org/no-such-model' is not a preset, not a local directory and not in the local" in message
    assert f"the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached" in message
    assert "simulated: no network" in message and "check the network connection" in message
    # one request; the HTTP client may look the name up twice for it (huggingface_hub's
    # retries would be five more, a minute of backing off)
    assert len(no_network) <= 2, f"retried: {no_network}"


def test_offline_check_lets_a_cached_model_through(empty_hub_cache, no_network, monkeypatch):
    """A hub id in the cache goes on to from_pretrained, offline or not, without a request."""
    from huggingface_hub import constants

    from rewy_hf.models.loading import _require_cached_or_reachable

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = empty_hub_cache / "models--rewy-test--cached"
    (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "snapshots" / rev / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for offline in (True, False):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        _require_cached_or_reachable("rewy-test/cached", None)
        _require_cached_or_reachable("rewy-test/cached", rev)
    assert no_network == []


def test_text_file_without_tokenizer_exits_2(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello " * 100)
    code, _, err = _run(["--model", "tiny-qwen3.5", "--text-file", str(text), *QUICK], capsys)
    assert code == 2 and "needs a tokenizer" in err


def test_text_file_through_the_models_tokenizer(saved_qwen, tmp_path, capsys):
    """A model directory with its own tokenizer: batches come from the text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = tmp_path / "with_tokenizer"
    shutil.copytree(saved_qwen, model_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(words[i % 200] for i in range(1000)))
    report = tmp_path / "parity.json"
    code, out, _ = _run(["--model", str(model_dir), "--text-file", str(text), "--json", str(report), *QUICK], capsys)
    assert code == 0, out
    assert json.loads(report.read_text())["optimized_backward_calls"] == 1


def test_a_tokenizer_that_fails_to_load_is_an_error_not_a_fallback(saved_qwen, tmp_path):
    """A model directory without tokenizer files has no tokenizer; one whose tokenizer files cannot be
    loaded is refused with the loader's reason and what to do, instead of being run on other ids."""
    from rewy_hf.models.loading import TokenizerLoadError, load_causal_lm

    assert load_causal_lm(str(saved_qwen)).tokenizer is None
    damaged = tmp_path / "damaged_tokenizer"
    shutil.copytree(saved_qwen, damaged)
    (damaged / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizerClass"}')
    with pytest.raises(TokenizerLoadError) as info:
        load_causal_lm(str(damaged))
    message = str(info.value)
    assert f"{str(damaged)!r} has a tokenizer, but it could not be loaded" in message
    assert "could not be loaded: ValueError: " in message, "the loader's reason"
    assert "Install the package it names" in message and "--trust-remote-code" in message


def _refusing(*args, **kwargs):
    raise RuntimeError("this core refuses to run here")


def test_crash_of_the_original_core_suggests_reference_torch(capsys, monkeypatch):
    """The unpatched model's own core refusing to run (as FLA's GDN backward does on
    some GPUs) is "could not run" with the way round it, not a traceback."""
    import importlib

    from rewy_hf.adapters import find_adapter
    from rewy_hf.patching.dispatch import CoreDispatcher

    (adapter,) = {a.site: a for a in map(find_adapter, build_preset("tiny-qwen3.5").modules()) if a}.values()
    module = importlib.import_module(adapter.site_module)
    site = getattr(module, adapter.site_attr)
    if isinstance(site, CoreDispatcher):
        # The module's core is put back too: should the patched model behind this dispatcher be
        # collected meanwhile, the dispatcher's original (the refusing core) becomes the module's core.
        monkeypatch.setattr(module, adapter.site_attr, site)
        monkeypatch.setattr(site, "original", _refusing)
    else:
        monkeypatch.setattr(module, adapter.site_attr, _refusing)
    code, _, err = _run(["--model", "tiny-qwen3.5", "--reference", "original", *QUICK], capsys)
    assert code == 2
    assert ("could not run: the unpatched model's own core failed: RuntimeError: this core refuses to run here; "
            "try --reference torch") in err


def test_crash_of_the_reference_core_gets_no_reference_hint(capsys, monkeypatch):
    """On CPU the unpatched side already runs the reference cores: --reference torch is no way out."""
    import rewy_hf.patching.reference_cores as rc

    monkeypatch.setattr(rc, "reference_for", lambda adapter, original: _refusing)
    code, _, err = _run(["--model", "tiny-qwen3.5", *QUICK], capsys)
    assert code == 2
    assert "could not run: RuntimeError: this core refuses to run here" in err
    assert "--reference" not in err
    assert "Traceback (most recent call last)" in err and "in _refusing" in err, "the crash is shown, not hidden"


def test_crash_outside_the_comparison_gets_no_reference_hint(capsys, monkeypatch):
    """A failure while loading or moving the model (here: a CUDA build that cannot run on
    this GPU) has nothing to do with the unpatched core: no --reference hint."""
    import rewy_hf.models.loading as loading

    def load(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(loading, "load_causal_lm", load)
    code, _, err = _run(["--model", "tiny-qwen3.5", *QUICK], capsys)
    assert code == 2
    assert "could not run: RuntimeError: CUDA error: no kernel image is available" in err
    assert "--reference" not in err


def test_lora_parity(tmp_path, capsys):
    report = tmp_path / "parity.json"
    code, out, _ = _run(["--model", "tiny-qwen3.5", "--lora", "--json", str(report), *QUICK], capsys)
    assert code == 0, out
    names = [g["name"] for g in json.loads(report.read_text())["gradients"]]
    assert names and all("lora_" in n for n in names), "only LoRA parameters are trainable under --lora"


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-kimi-linear", "tiny-olmo-hybrid", "tiny-qwen3.5-moe"])
def test_transformers_presets(preset, capsys):
    code, out, _ = _run(["--model", preset, *QUICK], capsys)
    assert code == 0, out


@pytest.mark.parametrize("preset", ["tiny-fla-deltanet", "tiny-fla-gdn", "tiny-fla-kda", "tiny-fla-gdn2"])
def test_fla_presets(preset, capsys):
    code, out, _ = _run(["--model", preset, *QUICK], capsys)
    assert code == 0, out


def test_list_presets_names_presets_and_architectures(capsys):
    from rewy_hf.adapters import all_adapters
    from rewy_hf.models.loading import preset_names

    code, out, _ = _run(["--list-presets"], capsys)
    assert code == 0
    presets, _, architectures = out.partition("supported architectures")
    assert set(preset_names()) <= set(presets.split()) and "tiny-qwen3.5" in presets and "gdn2-1b" in presets
    for adapter in all_adapters():
        for cls in adapter.layer_classes:
            (line,) = [ln for ln in architectures.splitlines() if ln.endswith(" " + cls)]
            assert line.split()[:2] == [adapter.source, adapter.op]


def test_without_a_model_exits_2_and_says_how(capsys):
    code, _, err = _run([], capsys)
    assert code == 2 and "--model is required" in err and "--list-presets" in err


def test_json_to_stdout_is_only_json(capsys):
    code, out, err = _run(["--model", "tiny-fla-gdn2", "--json", "-", *QUICK], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] is True and data["model"] == "tiny-fla-gdn2" and data["dtype"] == "float32"
    assert "PARITY HOLDS" in err


def test_tolerance_zero_is_honoured_and_negative_refused(saved_qwen, tmp_path, capsys):
    """--tolerance 0 asks for bit-identical gradients (was silently replaced by the default): the
    chunked core's gradients differ from the reference's in rounding, so parity is violated."""
    report = tmp_path / "parity.json"
    code, out, _ = _run(["--model", str(saved_qwen), "--tolerance", "0", "--json", str(report), *QUICK], capsys)
    data = json.loads(report.read_text())
    assert data["tolerance"]["grad_rel"] == 0.0
    assert code == 1 and any(g["rel_err"] > 0 for g in data["gradients"]), out
    for bad in ("-1", "nan", "inf"):
        code, _, err = _run(["--model", str(saved_qwen), "--tolerance", bad, *QUICK], capsys)
        assert code == 2 and "a tolerance is a finite number, 0 or more" in err, (bad, err)


def test_global_norm_is_the_l2_norm_over_all_gradients():
    import math

    import torch

    from rewy_hf.parity.comparison import global_norm

    grads = {"a": torch.tensor([3.0, 0.0], dtype=torch.bfloat16), "b": torch.tensor([[4.0], [12.0]])}
    assert global_norm(grads) == 13.0
    big = {"x": torch.full((4,), 1e30, dtype=torch.float32)}      # float32 squares would overflow
    assert math.isclose(global_norm(big), 2 * float(big["x"][0]), rel_tol=1e-12)
