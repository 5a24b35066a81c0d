"""benchmarks/kernel_configs.py on the CPU interpreter: the launch-config sweep
runs every stage it names, and configs that split the work differently (key
blocks or value tiles of another width) give the same
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


def _width(entry) -> tuple:
    kw, cfg = entry
    return kw.get("block_k"), cfg.kwargs.get("BV")


@pytest.mark.parametrize("kernel", ["kda-intra", "gdn2-intra", "kda-wy", "gdn-local"])
def test_configs_agree_on_the_same_inputs(kernel, capsys):
    """The reference config and the first one that splits the work differently (key-block width for
    Matrix Intra, value-tile width for the WY and GDN local kernels)."""
    module = _load()
    sweep = module.sweeps(kernel)
    other = next(i for i, e in enumerate(sweep) if _width(e) != _width(sweep[0]))
    picks = [0, other]
    if torch.cuda.is_available():
        device = ["--device", "cuda"]
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1"    # conftest switches the interpreter on
        device = ["--device", "cpu"]
    status = module.main([*device, "--kernel", kernel, "--B", "1", "--T", "128", "--H", "2", "--K", "64",
                          "--V", "64", "--pick", *map(str, picks), "--repeat", "2", "--tolerance", "1e-5"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.count(" diff ") == len(picks), out          # both configs ran; neither failed to compile
