"""GDN through FlashQLA inside rewy's boundary, on a GPU where flash-qla is installed.

``backend="auto"`` routes a GDN call that FlashQLA serves to the flash_qla backend; its
gradients are compared with rewy's torch backend on the same BF16 values in float32, and must
be as accurate as FlashQLA's own entry on the same call (within 10 %, plus a floor far below
BF16 rounding). The call compiles without a graph break, where FlashQLA's own entry is
``torch.compiler.disable``. Where FlashQLA splits one row (B = 1, dense or packed), its forward's
split reaches its backward through rewy's saved tensors, shaped and typed as the fake
implementation declares.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F

from compile_checks import assert_one_graph_with_eager_grads
from op_grads import outputs_and_grads

import rewy_hf
from rewy_hf.ops import last_backend
from rewy_hf.rel_error import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("flash_qla") is None,
                                                   reason="flash-qla is not installed")]


def _case(B, T, H, HV, cu=None, h0=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    if cu is not None:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    args = [r(B, T, H, 128).bfloat16(), r(B, T, H, 128).bfloat16(), r(B, T, HV, 128).bfloat16(),
            F.logsigmoid(r(B, T, HV) + 3), torch.rand(B, T, HV, device="cuda", generator=gen).bfloat16()]
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, device="cuda", dtype=torch.long)
    if h0:
        kw["initial_state"] = 0.3 * r(N, HV, 128, 128)
    return args, kw


@pytest.mark.parametrize("shape", [
    dict(B=2, T=1024, H=4, HV=4),
    dict(B=2, T=700, H=2, HV=8, h0=True),                  # GVA, ragged T
    dict(B=1, T=0, H=4, HV=4, cu=[0, 300, 1100, 2048], h0=True),   # FlashQLA splits this row
    dict(B=1, T=4096, H=2, HV=4),                                      # and this one
])
def test_auto_routes_to_flash_qla_and_matches_its_own_entry(shape):
    import flash_qla

    args, kw = _case(**shape)
    B, T, HV = args[2].shape[:3]
    do = torch.randn(B, T, HV, 128, device="cuda")
    N = B if "cu" not in shape else len(shape["cu"]) - 1
    dht = torch.randn(N, HV, 128, 128, device="cuda")
    ref = outputs_and_grads(lambda *a, **k: rewy_hf.chunk_gated_delta_rule(*a, backend="torch", policy="full",
                                                                           **k),
                            [a.float() for a in args], kw, do, dht)
    ours = outputs_and_grads(lambda *a, **k: rewy_hf.chunk_gated_delta_rule(*a, **k), args, kw, do, dht)
    assert last_backend() == "flash_qla"
    theirs = outputs_and_grads(lambda *a, **k: flash_qla.chunk_gated_delta_rule(*a, **k), args, kw, do, dht)
    for i, (x, y, r) in enumerate(zip(ours, theirs, ref)):
        assert rel_err(x, r) <= 1.1 * rel_err(y, r) + 1e-4, (i, rel_err(x, r), rel_err(y, r))


def test_explicit_triton_keeps_rewy_kernels():
    args, kw = _case(B=2, T=256, H=2, HV=2)
    rewy_hf.chunk_gated_delta_rule(*args, backend="triton", **kw)
    assert last_backend() == "triton"


def test_compiles_without_a_graph_break():
    args, kw = _case(B=2, T=512, H=2, HV=4)
    leaves = [a.detach().requires_grad_() for a in args]

    def f(*x):
        o, _ = rewy_hf.chunk_gated_delta_rule(*x, **kw)
        return o.float().square().sum()

    assert_one_graph_with_eager_grads(f, leaves)


@pytest.mark.parametrize("shape", [dict(B=1, T=4096, H=2, HV=4), dict(B=1, T=0, H=4, HV=4, cu=[0, 300, 1100, 2048])])
def test_split_is_saved_as_the_fake_implementation_declares(shape):
    """The op's real outputs, split tensors included, match its fake implementation, and the
    backward takes the forward's split as it is (FlashQLA warns and rebuilds on a mismatch)."""
    args, kw = _case(**shape)
    q, k, v, g, beta = args
    cu = kw.get("cu_seqlens")
    op_args = (q, k, v, g, beta, None, None, cu, 128 ** -0.5, "gdn", "recompute", False, False, False, "", "",
               "flash_qla")
    saved = torch.ops.rewy.delta_rule(*op_args)[2:]
    assert saved[2].shape[0] > 0, "FlashQLA did not split this row; the case no longer tests the split"
    result = torch.library.opcheck(torch.ops.rewy.delta_rule.default, op_args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert result == {name: "SUCCESS" for name in result} and len(result) == 2, result
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        leaves = [a.detach().requires_grad_() for a in args]
        o, _ = rewy_hf.chunk_gated_delta_rule(*leaves, **kw)
        o.float().square().sum().backward()
    assert last_backend() == "flash_qla" and all(x.grad is not None for x in leaves)
