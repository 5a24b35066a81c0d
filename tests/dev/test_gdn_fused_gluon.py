"""dev/gdn_fused_gluon.py: the fused GDN backward in Gluon compiles for sm_90 on a machine without a GPU,
fits one Hopper block's shared memory and runs its products on the warpgroup MMA; it refuses the shapes
it was not built for; its torch reference is the library's local backward (float64, on the CPU); on a
Hopper GPU its gradients are the reference's and those of rewy's split kernels.

The compile runs in a subprocess without TRITON_INTERPRET, which the other tests set and under which
nothing can be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dev_scripts import load_dev_script
from rewy_hf.kernels.constants import CHUNK as C
from rewy_hf.rel_error import rel_err
from scalar_gate_stages import kernel_inputs, stages, to_fla

DEV = Path(__file__).resolve().parents[2] / "dev"
HOPPER_BLOCK_SHARED = 227 * 1024          # the most shared memory one block may hold on sm_90
_ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def hopper(test):
    """A GPU test of the kernel, which is built for Hopper (sm_90) and skipped elsewhere."""
    return pytest.mark.gpu(pytest.mark.skipif(not _ON_HOPPER, reason="the kernel is built for Hopper (sm_90)")(test))


@pytest.fixture(scope="module")
def fused():
    return load_dev_script("gdn_fused_gluon")


def test_it_compiles_for_hopper_and_fits_one_block(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-P", str(DEV / "gdn_fused_gluon.py"), "--resources"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert row["triton"] == __import__("triton").__version__
    assert 0 < row["shared_bytes"] <= HOPPER_BLOCK_SHARED, row
    assert 0 < row["registers"] <= 255, row
    # the fifteen products of a chunk, each one or more warpgroup MMA instructions
    assert row["wgmma"] >= 15, row
    # warp specialised: two 4-warp consumer partitions and a 1-warp loader, counted in whole warpgroups
    assert row["warps"] == 12, row


def _assert_is_the_reference(got, ref, names=("dq", "dk", "dv", "dg", "db")):
    for name, a, b in zip(names, got, ref):
        assert torch.isfinite(a).all(), name
        # bf16 operands of every product (dV2, dY, dh, the masked gram tiles) against a float64 walk
        assert rel_err(a.double(), b) < 1e-2, name


@pytest.mark.parametrize("bad", ["K", "T", "dtype"])
def test_it_refuses_what_it_was_not_built_for(fused, bad):
    B, T, H, K, V = 1, 128, 1, 128, 128
    if bad == "K":
        K = 64
    elif bad == "T":
        T = 100
    dtype = torch.float32 if bad == "dtype" else torch.bfloat16
    q = torch.zeros(B, T, H, K, dtype=dtype)
    v = torch.zeros(B, T, H, V, dtype=dtype)
    with pytest.raises(ValueError, match="bf16, K = V = 128 and T a multiple of 64"):
        fused.fused_backward(q, q, v, v, None, None, None, None, v)


@hopper
@pytest.mark.parametrize("shape", [(2, 512, 4), (1, 1024, 2)])
def test_gradients_are_the_split_kernels(fused, shape):
    s = fused.split_backward_inputs(*shape)
    got = fused.fused_backward(*fused.kernel_args(s), scale=s["scale"])
    for name, a, b in zip(("dq", "dk", "dv", "dg", "db"), got, s["out"]):
        a, b = a.float(), b.float()
        assert torch.isfinite(a).all(), name
        # both sides round their 16-bit intermediates (dV2, dY, dh) at different points: measured
        # 1.7e-3 to 3.7e-3 at (8, 2048, 16) on an H100
        assert ((a - b).norm() / b.norm()).item() < 1e-2, name


@hopper
@pytest.mark.parametrize("shape", [(1, 64, 1), (1, 128, 1), (2, 512, 4)])
def test_gradients_are_the_reference_on_synthetic_inputs(fused, shape):
    """One chunk, two (the hand-offs' second phase) and several: no forward, no autotuning."""
    s = fused.synthetic_inputs(*shape)
    args = fused.kernel_args(s)
    got = fused.fused_backward(*args, scale=s["scale"])
    ref = fused.reference_backward(*args, scale=s["scale"], dtype=torch.float64)
    _assert_is_the_reference(got, ref)


@hopper
@pytest.mark.parametrize("shape,HV", [((1, 128, 1), 2), ((2, 256, 2), 8)])
def test_value_heads_sharing_a_key_head_are_the_reference(fused, shape, HV):
    """dq and dk per value head in fp32 (the caller sums them over each group), stored per thread, not by TMA."""
    s = fused.synthetic_inputs(*shape, HV=HV)
    args = fused.kernel_args(s)
    got = fused.fused_backward(*args, scale=s["scale"])
    ref = fused.reference_backward(*args, scale=s["scale"], dtype=torch.float64)
    assert got[0].dtype == torch.float32 and got[0].shape[2] == HV
    _assert_is_the_reference(got, ref)


@hopper
def test_the_state_gradient_enters_and_leaves(fused):
    """A final-state gradient dht enters the walk and the initial state's gradient dh0 leaves it. Two chunks,
    so dht still weighs in dh0 (over more chunks their own terms outgrow it)."""
    B, T, H = 2, 128, 2
    s = fused.synthetic_inputs(B, T, H, seed=3)
    args = fused.kernel_args(s)
    dht = torch.randn(B, H, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    got = fused.fused_backward(*args, dht=dht, h0=torch.zeros_like(dht), scale=s["scale"])
    ref = fused.reference_backward(*args, scale=s["scale"], dht=dht, dtype=torch.float64)
    without = fused.reference_backward(*args, scale=s["scale"], dtype=torch.float64)
    _assert_is_the_reference(got, ref, ("dq", "dk", "dv", "dg", "db", "dh0"))
    for name, b, w in zip(("dk", "dv", "dg", "db", "dh0"), ref[1:], without[1:]):   # dq reads h, not dh
        # dht changes the gradient by far more than the tolerance, so the check above sees it
        assert rel_err(w, b) > 5e-2, name


@pytest.mark.parametrize("HV,log_gate", [(1, None), (2, None), (2, -0.02)])
def test_reference_is_the_torch_backends_local_backward(fused, HV, log_gate):
    """The reference the kernel is checked against on a GPU (its walk and local gradients in torch) gives,
    fed the torch backend's float64 stages, that backend's local gradients: the fused kernel's algebra is
    the library's. Small K and V: the reference takes any. Log-gates near -0.02 keep a chunk's decay near
    0.3, so the carried state's terms (its decay's gradient, K dh in dV2) weigh as much as the local ones."""
    T, K, V, N, H = 3 * C, 32, 16, 2, 1
    x, gt, s, do, dVn, dHnext, ref = stages("gdn", N, H, HV, T // C, K, V, T, seed=21 + HV, log_gate=log_gate,
                                            dtype=torch.float64)
    a = kernel_inputs("gdn", x, gt, s, do, dVn, dHnext, T, H, HV)
    got = fused.reference_backward(a["q"], a["k"], a["v"], a["v_new"], a["g"], a["beta"], a["A"], a["h"], a["do"],
                                   scale=x.scale, dht=a["dh"][:, -1], dtype=torch.float64)
    errors = {}
    for name, out, r in zip(("dq", "dk", "dv", "dg", "db"), got, ref[:5]):
        r = to_fla(r, T)
        errors[name] = rel_err(out, r[..., 0] if name in ("dg", "db") else r)
    assert max(errors.values()) < 1e-10, errors
