"""`rewy-hf parity --packed` on CPU: one packed row of 80 tokens (documents 64 + 9 + 1 + 6) against
its documents run one by one, on tiny Qwen3.5 and Kimi-Linear. The patched model holds, the unpatched
one is reported leaking, and a patched model that loses the document bounds fails."""

from __future__ import annotations

import json

import pytest

from rewy_hf.cli import main
from rewy_hf.parity.packed import CHUNK, MIN_TOKENS, document_lengths

PACKED = ["--packed", "--seq-len", "80"]
FORMS = {"position_ids", "position_ids + cu_seq_lens"}


def _run(argv, capsys, tmp_path):
    report = tmp_path / "parity.json"
    code = main(["parity", *argv, "--json", str(report)])
    out = capsys.readouterr()
    return code, out.out, out.err, json.loads(report.read_text())


def _rows(data: dict, model: str) -> dict[str, dict]:
    rows = {r["given"]: r for r in data["packed"]["rows"] if r["model"] == model}
    assert rows.keys() == FORMS
    return rows


# Kimi-Linear is checked in float32 only: its MoE experts run torch's grouped_mm, which takes no
# float64 on CPU (the batch comparison cannot run it in float64 either).
@pytest.mark.parametrize("preset,dtype", [("tiny-qwen3.5", "float64"), ("tiny-qwen3.5", "float32"),
                                          ("tiny-kimi-linear", "float32")])
def test_patched_packed_row_equals_its_documents_and_unpatched_leaks(preset, dtype, capsys, tmp_path):
    code, out, _, data = _run(["--model", preset, "--dtype", dtype, *PACKED], capsys, tmp_path)
    assert code == 0, out
    packed = data["packed"]
    assert data["ok"] is True and data["exit_code"] == 0 and packed["ok"] is True
    assert packed["lengths"] == [64, 9, 1, 6] and packed["bounds"] == [64, 73, 74]
    assert packed["optimized_backward_calls"] > 0
    tol = packed["tolerance"]["grad_rel"]
    assert tol == {"float64": 1e-6, "float32": 1e-3}[dtype]
    for row in _rows(data, "patched").values():
        assert row["ok"] and row["failing"] == []
        assert row["max_grad_rel_err"] <= tol
        # float64: the packed logits are the documents' to float64 rounding (every op on them is float64)
        assert row["logits_rel_err"] <= (1e-12 if dtype == "float64" else 1e-5)
    # transformers' own layers run each document on from the one before: far outside any tolerance
    for row in _rows(data, "unpatched").values():
        assert not row["ok"] and row["logits_rel_err"] > 1e-3 and row["max_grad_rel_err"] > 1e-2
    assert packed["unpatched_leaks"] is True
    assert "the unpatched model leaks across packed documents" in out
    assert "PACKED ROWS HOLD" in out
    table = out[out.index("model      row given as"):]
    assert [line.split()[-1] for line in table.splitlines()[2:6]] == ["OK", "OK", "LEAKS", "LEAKS"]


def _drop_derived_bounds(monkeypatch):
    """The model's forward no longer derives bounds from restarting position_ids."""
    import rewy_hf.patching.packing as packing

    monkeypatch.setattr(packing, "_derive", lambda positions: None)


def _conv_ignores_bounds(monkeypatch):
    """rewy's short convolution runs across document starts (the core still gets the bounds)."""
    import rewy_hf.patching.dispatch as dispatch

    monkeypatch.setattr(dispatch, "packed_bounds", lambda kwargs: None)


@pytest.mark.parametrize("fault,broken", [(_drop_derived_bounds, {"position_ids"}), (_conv_ignores_bounds, FORMS)],
                         ids=["bounds-not-derived", "convolution-across-documents"])
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-kimi-linear"])
def test_a_patched_model_that_loses_the_bounds_fails(preset, fault, broken, capsys, tmp_path, monkeypatch):
    """Where the patched model runs across documents, exit 1, naming the row forms it leaks on; a
    row whose collator passed the bounds itself still holds when only their derivation is lost."""
    fault(monkeypatch)
    code, out, _, data = _run(["--model", preset, *PACKED], capsys, tmp_path)
    assert code == 1 and data["exit_code"] == 1 and data["ok"] is False, out
    rows = _rows(data, "patched")
    assert {given for given, row in rows.items() if not row["ok"]} == broken
    for given in broken:
        assert rows[given]["logits_rel_err"] > 1e-3 and rows[given]["failing"]
    assert "PACKED ROWS VIOLATED" in out and "worst offenders (patched)" in out


def test_packed_holds_the_patched_model_to_itself(capsys, tmp_path, monkeypatch):
    """--packed measures packing alone: a core whose gradients are off on every input (the test
    fault scales them all) is off alike in the packed row and in the documents, so --packed holds,
    while the batch comparison, rewy's core against the model's own, fails."""
    monkeypatch.setenv("REWY_HF_TEST_FAULT", "grad_scale=1.07")
    with pytest.warns(RuntimeWarning, match="deliberately corrupting"):
        code, out, _, data = _run(["--model", "tiny-qwen3.5", *PACKED], capsys, tmp_path)
    assert code == 0 and data["packed"]["ok"] is True, out
    code, out, _, data = _run(["--model", "tiny-qwen3.5", "--steps", "1", "--batch-size", "1", "--seq-len", "80",
                               "--no-update"], capsys, tmp_path)
    assert code == 1 and "PARITY VIOLATED" in out


def test_bfloat16_failure_says_how_to_tell_rounding_from_a_leak(capsys, tmp_path, monkeypatch):
    _conv_ignores_bounds(monkeypatch)
    code, out, _, _ = _run(["--model", "tiny-qwen3.5", "--dtype", "bfloat16", *PACKED], capsys, tmp_path)
    assert code == 1
    assert "--dtype float32 tells it from a leak" in out


def test_packed_refuses_batch_only_options_and_a_short_row(capsys, tmp_path):
    code = main(["parity", "--model", "tiny-qwen3.5", "--packed", "--compile", "--no-update"])
    err = capsys.readouterr().err
    assert code == 2 and "--compile, --no-update apply to the batch comparison, not to --packed" in err
    assert "run without --packed" in err
    code, _, err, data = _run(["--model", "tiny-qwen3.5", "--packed", "--seq-len", str(MIN_TOKENS - 1)], capsys,
                              tmp_path)
    assert code == 2 and data["exit_code"] == 2
    assert f"--packed needs --seq-len {MIN_TOKENS} or more (got {MIN_TOKENS - 1})" in err


def test_document_lengths_put_one_bound_on_a_chunk_edge_and_the_rest_inside_chunks():
    for seq_len in range(MIN_TOKENS, 1000):
        lengths = document_lengths(seq_len)
        assert sum(lengths) == seq_len and min(lengths) >= 1 and lengths[2] == 1, (seq_len, lengths)
        bounds = [sum(lengths[:i]) for i in range(1, len(lengths))]
        assert bounds[0] == CHUNK and all(b % CHUNK for b in bounds[1:]), (seq_len, bounds)
