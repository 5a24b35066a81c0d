"""dev/first_calls.py: a packed bench run on the CPU logs each training step once, in order, and the
first call of each attention signature once, timed."""

from __future__ import annotations

import re

import pytest

from dev_scripts import load_dev_script


@pytest.fixture(scope="module")
def first_calls():
    return load_dev_script("first_calls")


def test_a_packed_run_logs_its_steps_and_attention_signatures(first_calls, tmp_path, monkeypatch):
    import torch.nn.functional as F

    from rewy_hf.bench import compile_bench, model_bench, packed_bench

    for module in (packed_bench, compile_bench, model_bench):     # the script rebinds these; undo after
        monkeypatch.setattr(module, "train_step", module.train_step)
    monkeypatch.setattr(F, "scaled_dot_product_attention", F.scaled_dot_product_attention)
    log = tmp_path / "calls.log"
    with pytest.raises(SystemExit) as done:
        first_calls.main(["--log", str(log), "bench", "--model", "tiny-qwen3.5", "--device", "cpu", "--packed",
                          "--no-documents-check", "--steps", "3", "--sides", "unpatched-eager"])
    assert done.value.code == 0
    lines = log.read_text().splitlines()
    steps = [int(m.group(1)) for x in lines if (m := re.search(r" step (\d+)$", x))]
    # one untimed step that makes AdamW's state, 1 warm-up step, 3 timed steps (no profiled step on the CPU)
    assert steps == list(range(5))
    attention = [x for x in lines if "attention first call" in x]
    assert attention and all(re.search(r"attention first call mask - \(1, \d+, \d+, \d+\) float32 grad: \d+\.\d ms$", x)
                             for x in attention)
    assert len(set(x.split(" first call ")[1].split(":")[0] for x in attention)) == len(attention)
