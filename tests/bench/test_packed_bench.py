"""`rewy-hf bench --model X --packed`: its packings, its documents check, the command on the CPU
(tiny model, eager sides), and runs of some sides each joined by `--from-json`."""

from __future__ import annotations

import json

import pytest
import torch

from bench_cli import run_bench, run_lab

from rewy_hf.bench import packed_bench
from rewy_hf.models.presets import build_preset

TINY = ["--model", "tiny-qwen3.5", "--packed", "--device", "cpu", "--warmup", "1", "--steps", "3"]


def test_packings_fill_the_row_and_mark_each_document():
    batches, lengths = packed_bench.packings(4, 8192, 248320, seed=0, device="cpu")
    assert len({tuple(x) for x in lengths}) == 4, "a new packing every step"
    for batch, lens in zip(batches, lengths):
        assert sum(lens) == 8192 and min(lens[:-1]) >= 16 and len(lens) > 2
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        assert torch.equal((batch["position_ids"][0] == 0).nonzero().squeeze(1), starts)
        assert torch.equal((batch["labels"][0] == -100).nonzero().squeeze(1), starts)
        assert batch["input_ids"].shape == (1, 8192) and int(batch["input_ids"].max()) < 248320


def test_documents_check_separates_the_patched_model_from_the_leaking_one():
    model = build_preset("tiny-qwen3.5").train()
    out = packed_bench.documents_check(model, "cpu")
    assert sum(out["lengths"]) == packed_bench.CHECK_TOKENS
    patched, unpatched = out["patched"], out["unpatched"]
    # float32 against the float32 reference: the documents alone are that reference itself
    assert patched["alone"]["logits_rel_err"] == 0 and patched["alone"]["grads_rel_err"] == 0
    assert patched["packed"]["logits_rel_err"] < 1e-5 and patched["packed"]["grads_rel_err"] < 1e-5
    assert unpatched["alone"]["logits_rel_err"] < 1e-5      # transformers' torch core agrees on one document
    assert unpatched["packed"]["logits_rel_err"] > 1e-3 and unpatched["packed"]["grads_rel_err"] > 1e-3
    assert packed_bench.packed_problems({"documents_check": out}) == []
    leaking = {**out, "patched": unpatched}
    assert len(packed_bench.packed_problems({"documents_check": leaking})) == 2


@pytest.fixture(scope="module")
def unpatched_run(tmp_path_factory):
    """One CPU run of the unpatched eager side with the documents check, shared."""
    path = tmp_path_factory.mktemp("packed") / "unpatched.json"
    code = packed_bench_cli([*TINY, "--sides", "unpatched-eager", "--json", str(path)])
    assert code == 0
    return path


def packed_bench_cli(argv):
    from rewy_hf import cli

    return cli.main(["bench", *argv])


def test_the_command_times_each_side_over_new_packings(unpatched_run, tmp_path, capsys):
    plot, md, path = tmp_path / "packed.png", tmp_path / "packed.md", tmp_path / "patched.json"
    code, out, err = run_bench([*TINY, "--sides", "patched-eager", "--no-documents-check", "--json", str(path)],
                               capsys)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["kind"] == "packed" and data["complete"] and "documents_check" not in data
    side = data["sides"]["patched eager"]
    assert len(side["step_ms"]) == 3 and len(side["loss"]) == 1 + 3 and side["peak_mb"] is None
    assert "stopped_after_steps" not in side              # the finished side replaced its partial saves
    assert side["dispatch"]["ops"]["gated_delta_rule"]["optimized_backward_calls"] >= 3
    assert data["documents_per_step"] == [len(x) for x in packed_bench.packings(
        3, 256, build_preset("tiny-qwen3.5").config.vocab_size, 0, "cpu")[1]]
    assert min(data["documents_per_step"]) > 1

    code, out, err = run_lab(["--from-json", str(unpatched_run), str(path), "--plot", str(plot),
                                "--markdown", str(md)], capsys)
    assert code == 0, err
    for name in ("unpatched eager", "patched eager"):
        assert name in out and name in md.read_text()
    assert "documents check" in out and plot.stat().st_size > 10_000


def test_each_side_says_what_its_first_step_waits_for_before_the_bar_moves():
    model = build_preset("tiny-qwen3.5")
    calls = []
    packed_bench.run_packed_bench(model, device="cpu", steps=2, warmup=1, seq_len=128, seed=0, backend="auto",
                                  policy="recompute", sides=("unpatched eager", "patched eager"), check=False,
                                  on_side=lambda side, row: None, step=lambda label, units=1: calls.append((label, units)))
    assert calls == [("unpatched eager: first step, building kernels", 0), *[("unpatched eager", 1)] * 3,
                     ("patched eager: first step, building kernels", 0), *[("patched eager", 1)] * 3]


def test_a_side_stopped_part_way_keeps_the_steps_it_timed(tmp_path, capsys, monkeypatch):
    """A run stopped in the middle of a side (Ctrl-C, a time limit) leaves a JSON file with the steps
    that side had timed, marked as stopped, and joining it says so."""
    path, real, calls = tmp_path / "stopped.json", packed_bench.train_step, []

    def stopped_at_the_fifth_step(*args, **kwargs):
        calls.append(1)
        # the step that makes AdamW's state, one warm-up step, two timed steps; the third is stopped
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_bench, "train_step", stopped_at_the_fifth_step)
    with pytest.raises(KeyboardInterrupt):
        packed_bench_cli([*TINY, "--sides", "patched-eager", "--no-documents-check", "--json", str(path)])
    data = json.loads(path.read_text())
    side = data["sides"]["patched eager"]
    assert not data["complete"] and side["stopped_after_steps"] == 2
    assert len(side["step_ms"]) == 2 and len(side["loss"]) == 1 + 2
    assert side["dispatch"]["ops"]["gated_delta_rule"]["optimized_backward_calls"] >= 3
    assert not list(tmp_path.glob("*.tmp-*")), "the report is written whole or not at all"
    code, out, err = run_lab(["--from-json", str(path)], capsys)
    assert "patched eager (stopped after 2 of 3 steps)" in out
    assert code == 1 and "did not finish" in out


def test_a_run_that_fails_in_a_later_side_keeps_and_joins_the_sides_it_finished(unpatched_run, tmp_path, capsys,
                                                                                 monkeypatch):
    path, real, calls = tmp_path / "failed.json", packed_bench.train_step, []

    def fails_in_the_second_side(*args, **kwargs):
        calls.append(1)
        # the first side: the step that makes AdamW's state, one warm-up step, three timed steps
        if len(calls) > 5:
            raise RuntimeError("the compiled side failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_bench, "train_step", fails_in_the_second_side)
    code = packed_bench_cli([*TINY, "--sides", "patched-eager,patched-compiled", "--no-documents-check",
                             "--json", str(path)])
    data = json.loads(path.read_text())
    assert code == 2 and "the compiled side failed" in data["error"]
    assert list(data["sides"]) == ["patched eager"] and len(data["sides"]["patched eager"]["step_ms"]) == 3

    code, out, err = run_lab(["--from-json", str(path)], capsys)
    assert code == 2 and "patched eager" in out and "stopped after the sides above" in out
    code, out, err = run_lab(["--from-json", str(unpatched_run), str(path)], capsys)
    assert code == 2, err
    assert "unpatched eager" in out and "patched eager" in out
    assert f"problem: {path}: RuntimeError: the compiled side failed" in out


def test_joining_refuses_a_side_twice_and_two_documents_checks(unpatched_run, capsys):
    code, _, err = run_lab(["--from-json", str(unpatched_run), str(unpatched_run)], capsys)
    assert code == 2 and "unpatched eager side is in both" in err


@pytest.mark.parametrize("extra, message", [(["--compile"], "belong to the --compile bench"),
                                            (["--batch-size", "2"], "one row per step"),
                                            (["--sides", "patched-compiled", "--warmup", "0"], "--warmup 1 or more")])
def test_options_that_do_not_fit_are_refused(extra, message, capsys):
    code, _, err = run_bench([*TINY, *extra], capsys)
    assert code == 2 and message in err


def test_summary_holds_each_side_to_the_fastest_unpatched_one():
    def side(tokens_per_s, peak):
        return {"tokens_per_s": tokens_per_s, "peak_mb": peak}

    data = {"sides": {"unpatched eager": side(100, 10), "unpatched eager + liger": side(120, 5),
                      "patched compiled": side(180, 8), "patched eager + liger": {"skipped": "no"}}}
    summary = packed_bench.packed_summary(data)
    assert summary["fastest_unpatched"] == "unpatched eager + liger"
    assert summary["vs_fastest_unpatched"]["patched compiled"] == {"speedup": 1.5, "peak_ratio": 1.6}
    assert "patched eager + liger" not in summary["vs_fastest_unpatched"]
