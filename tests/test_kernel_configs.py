"""benchmarks/kernel_configs.py on the CPU interpreter: the launch-config sweep
runs every stage it names, and configs that split the work differently (key
blocks of 64 vs 32 channels, value tiles of 32 / 64 / 128) give the same
outputs, so the sweep's own agreement check cannot pass by accident on the GPU.
Under the interpreter warps and stages change nothing; block widths do."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_configs.py"


def _load():
    spec = importlib.util.spec_from_file_location("kernel_configs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernel, picks", [
    ("kda-intra", [0, 10]),       # 64- and 32-channel key blocks
    ("gdn2-intra", [0, 10]),
    ("kda-wy", [0, 2]),           # value tiles of 64 and 32
    ("gdn-local", [0, 3]),        # value tiles of 32 and 128
])
def test_configs_agree_on_the_same_inputs(kernel, picks, capsys):
    if torch.cuda.is_available():
        device = ["--device", "cuda"]
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1"    # conftest switches the interpreter on
        device = ["--device", "cpu"]
    status = _load().main([*device, "--kernel", kernel, "--B", "1", "--T", "128", "--H", "2", "--K", "64",
                           "--V", "64", "--pick", *map(str, picks), "--repeat", "2", "--tolerance", "1e-5"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.count(" diff ") == len(picks), out          # every picked config ran; none failed to compile
