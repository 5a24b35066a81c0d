"""Every launch config that rewy's autotuners may pick gives the outputs of the first one, on the GPU.

The other GPU tests run one config per kernel (conftest.py), and an autotuner picks by speed alone,
so a config that the GPU's Triton miscompiles would pass them and then hand wrong gradients to
whoever's shape selects it. That happened: with 4 warps, BV 64 and key blocks narrower than 64,
triton 3.6.0 computed Residual WY's dk 19 % off on the H200. Here each listed
config that survives the kernel's own pruning runs alone on the same inputs, at K = 128 (64-channel
key blocks) and K = 32 (32-channel ones); configs only reorder the same products, so their outputs
agree to float rounding, and a rerun must repeat them exactly."""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.triton_backend.tiles import key_block
from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu


def _kernel_configs(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "dev"))   # the developer scripts
    import kernel_configs

    monkeypatch.setattr(kernel_configs, "DEVICE", "cuda")
    return kernel_configs


def _allowed(kern, K: int, V: int) -> list:
    listed = getattr(kern, "listed_configs", kern.configs)
    if kern.early_config_prune is None:
        return listed
    # the launch arguments the kernels' pruning reads: the key block (wrapper default) and V
    return kern.early_config_prune(listed, {}, BK=key_block(K), V=V)


@pytest.mark.parametrize("K", [128, 32])
@pytest.mark.parametrize("name", ["kda-wy", "gdn2-wy", "kda-intra", "gdn2-intra", "gdn-local"])
def test_each_allowed_config_matches_the_first(name, K, monkeypatch):
    KC = _kernel_configs(monkeypatch)
    V = 128
    kern, fn = KC.stage(name, 1, 512, 4, K, V)
    configs = _allowed(kern, K, V)
    assert configs, "the pruning left no config"
    ref, errors = None, {}
    for cfg in configs:
        with KC.only_config(kern, cfg):
            outs = KC.comparable(name, fn())
            again = KC.comparable(name, fn())
        torch.cuda.synchronize()
        label = f"BV={cfg.kwargs.get('BV')} warps={cfg.num_warps} stages={cfg.num_stages}"
        assert all(torch.equal(a, b) for a, b in zip(outs, again)), f"{label}: a rerun changed the outputs"
        if ref is None:
            ref = outs
            continue
        errors[label] = max(rel_err(o, r) for o, r in zip(outs, ref))
    assert all(e < 1e-4 for e in errors.values()), errors
