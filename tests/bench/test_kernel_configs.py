"""dev/kernel_configs.py on the CPU interpreter: the launch-config sweep
runs every stage it names, and configs that split the work differently (key
blocks or value tiles of another width) give the same
outputs, so the sweep's own agreement check cannot pass by accident on the GPU.
Under the interpreter warps and stages change nothing; block widths do."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The developer scripts live in dev/ at the repository root, not in the installed package.
DEV = Path(__file__).resolve().parents[2] / "dev"


def _load():
    if str(DEV) not in sys.path:
        sys.path.insert(0, str(DEV))
    import kernel_configs

    return kernel_configs


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
    status = module.main([*device, "--kernel", kernel, "--B", "1", "--T", "128", "--H", "1", "--K", "64",
                          "--V", "64", "--pick", *map(str, picks), "--repeat", "2", "--tolerance", "1e-5"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.count(" diff ") == len(picks), out          # both configs ran; neither failed to compile


def test_wy_key_blocks_of_another_width_agree(capsys):
    """KDA's Residual WY with 32-channel key blocks against the reference's 64 (K = 64: one key block
    against two): its erase-gate partials then come in buffers of different widths, which the sweep
    compares through their sum over the slots, the quantity Matrix Intra consumes."""
    module = _load()
    sweep = module.sweeps("kda-wy")
    other = next(i for i, (kw, _) in enumerate(sweep) if kw.get("block_k") == 32)
    device = ["--device", "cuda"] if torch.cuda.is_available() else ["--device", "cpu"]
    status = module.main([*device, "--kernel", "kda-wy", "--B", "1", "--T", "128", "--H", "1", "--K", "64",
                          "--V", "64", "--pick", "0", str(other), "--tolerance", "1e-5"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.count(" diff ") == 2 and "block_k=32" in out, out


@pytest.mark.parametrize("kernel", ["kda-intra", "gdn-local"])
def test_baseline_version_runs_on_the_same_inputs(kernel, tmp_path, capsys):
    """--baseline with a copy of the current kernel files: the same code on the same inputs must agree
    to rounding, which also proves both sides saw the same inputs (they are seeded, not drawn from
    the global generator)."""
    import shutil

    from rewy_hf.kernels.triton_backend.scalar_gate import local_backward
    from rewy_hf.kernels.triton_backend.vector_gate import intra_backward, wy_backward

    for mod in (wy_backward, intra_backward, local_backward):
        shutil.copy(mod.__file__, tmp_path)
    module = _load()
    device = ["--device", "cuda"] if torch.cuda.is_available() else ["--device", "cpu"]
    status = module.main([*device, "--kernel", kernel, "--B", "1", "--T", "64", "--H", "1", "--K", "64",
                          "--V", "64", "--pick", "0", "--tolerance", "1e-6", "--baseline", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    line = next(x for x in out.splitlines() if "baseline" in x)
    assert float(line.rsplit("diff ", 1)[1]) <= 1e-6, line


def test_baseline_folder_without_kernel_files_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _load().main(["--device", "cpu", "--kernel", "kda-intra", "--baseline", str(tmp_path)])
    assert "holds none of wy_backward.py, intra_backward.py, local_backward.py" in capsys.readouterr().err


def test_baseline_that_computes_otherwise_is_reported(tmp_path, capsys):
    """A baseline whose Matrix Intra adds the row gradient twice: its outputs must differ from the
    current kernel's, and the exit status must say so."""
    from rewy_hf.kernels.triton_backend.vector_gate import intra_backward

    src = open(intra_backward.__file__).read()
    old = "b_dq = tl.load(dq + off_k, mask=m_ik, other=0.0) + b_Rq"
    assert src.count(old) == 1
    (tmp_path / "intra_backward.py").write_text(src.replace(old, old + " * 2.0"))
    device = ["--device", "cuda"] if torch.cuda.is_available() else ["--device", "cpu"]
    status = _load().main([*device, "--kernel", "kda-intra", "--B", "1", "--T", "64", "--H", "1", "--K", "64",
                           "--V", "64", "--pick", "0", "--baseline", str(tmp_path)])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "baseline" in x)
    assert status == 1 and float(line.rsplit("diff ", 1)[1]) > 1e-3, out
