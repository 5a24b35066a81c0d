"""Torch backend vs autograd through the float64 token-by-token recurrence.

Every case compares the output, the final state and the gradient of every
input (q, k, v, gates, betas, gate parameters, initial state) with a relative
error bound of 1e-10. Inputs are drawn fresh each run; the seed is printed in
the failure message so a failure can be replayed.
"""

from __future__ import annotations

import random

import pytest
import torch

import rewy_hf
from rewy_hf.kernels import reference
from rewy_hf.rel_error import rel_err

from op_cases import OPS, make_case

TOL = 1e-10

OURS = {"delta_rule": rewy_hf.chunk_delta_rule, "gdn": rewy_hf.chunk_gated_delta_rule,
        "kda": rewy_hf.chunk_kda, "gdn2": rewy_hf.chunk_gdn2}
REF = {"delta_rule": reference.naive_delta_rule, "gdn": reference.naive_gated_delta_rule,
       "kda": reference.naive_kda, "gdn2": reference.naive_gdn2}

# name -> (ops it applies to, make_case options, extra kwargs for our op only)
CASES = {
    "plain_ragged_T": (OPS, dict(T=150), {}),
    "short_T": (OPS, dict(T=9), {}),
    "initial_state": (OPS, dict(h0=True), {}),
    "cu_seqlens_3": (OPS, dict(cu=[0, 37, 150, 213], h0=True), {}),
    "l2norm": (OPS, dict(l2=True), {}),
    "full_policy": (OPS, dict(h0=True, l2=True), dict(disable_recompute=True)),
    "full_policy_cu": (OPS, dict(cu=[0, 70, 75, 140], h0=True), dict(policy="full")),
    "strong_decay": (("gdn", "kda", "gdn2"), dict(regime="strong_decay", h0=True), {}),
    "long_memory": (("gdn", "kda", "gdn2"), dict(regime="long_memory", h0=True), {}),
    "tiny_beta": (OPS, dict(regime="tiny_beta", h0=True), {}),
    "gva": (("gdn", "kda"), dict(H=2, HV=4, h0=True), {}),
    "gva_cu_full": (("gdn", "kda"), dict(H=1, HV=3, cu=[0, 64, 65, 190], h0=True), dict(policy="full")),
    "state_v_first": (("gdn", "kda", "gdn2"), dict(h0=True, v_first=True), {}),
    "fused_gate": (("gdn", "kda", "gdn2"), dict(gate_in_kernel=True, h0=True), {}),
    "fused_gate_lower_bound": (("kda", "gdn2"), dict(gate_in_kernel=True, lower_bound=-5.0), {}),
    "beta_sigmoid": (("gdn", "kda"), dict(beta_sigmoid=True), {}),
    "neg_eigval": (("gdn", "kda"), dict(beta_sigmoid=True, neg_eig=True, h0=True), {}),
    "everything": (("gdn", "kda"), dict(H=2, HV=4, cu=[0, 100, 129, 260], h0=True, l2=True,
                                        gate_in_kernel=True, beta_sigmoid=True, neg_eig=True,
                                        v_first=True), {}),
}

PARAMS = [pytest.param(op, name, id=f"{op}-{name}") for name, (ops, _, _) in CASES.items() for op in ops]


@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no_dht"])
@pytest.mark.parametrize("op,case", PARAMS)
def test_matches_float64_recurrence(op, case, with_dht):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    _, opts, ours_only = CASES[case]
    args, kwargs, leaves = make_case(op, gen, **opts)

    o_ref, ht_ref = REF[op](*args, **kwargs)
    o, ht = OURS[op](*args, backend="torch", **kwargs, **ours_only)
    assert o.dtype == torch.float64 and ht.dtype == torch.float64

    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64) if with_dht else None
    loss_ref = (o_ref * do).sum() + ((ht_ref * dht).sum() if with_dht else 0)
    loss = (o * do).sum() + ((ht * dht).sum() if with_dht else 0)
    grads_ref = torch.autograd.grad(loss_ref, leaves)
    grads = torch.autograd.grad(loss, leaves)

    errors = {"o": rel_err(o, o_ref), "final_state": rel_err(ht, ht_ref)}
    names = ["arg%d" % i for i in range(len(args))] + [k for k in ("initial_state", "A_log", "dt_bias") if k in kwargs]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g is not None, f"no gradient for {name}"
        errors["d" + name] = rel_err(g, g_ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"seed={seed}: {worst} rel err {errors[worst]:.2e} > {TOL}; all: {errors}"


def test_output_dtypes_follow_fla():
    """bf16 in, bf16 out; the final state is float32 (FLA's convention)."""
    gen = torch.Generator().manual_seed(0)
    args, kwargs, _ = make_case("gdn", gen, T=20, h0=True)
    args = [a.detach().to(torch.bfloat16) for a in args]
    kwargs["initial_state"] = kwargs["initial_state"].detach().float()
    o, ht = rewy_hf.chunk_gated_delta_rule(*args, **kwargs)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref, ht_ref = reference.naive_gated_delta_rule(*args, **kwargs)
    assert rel_err(o.float(), o_ref) < 2e-2 and rel_err(ht, ht_ref) < 1e-2


@pytest.mark.parametrize("op", OPS)
def test_autocast_keeps_float32_math(op):
    """Under mixed-precision training (autocast bf16) the core still computes in float32:
    outputs and gradients equal those of the same float32 call outside autocast."""
    gen = torch.Generator().manual_seed(3)
    args, kwargs, leaves = make_case(op, gen, T=70, h0=True)
    args = [a.detach().float() if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: (v.detach().float() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    fn = OURS[op]

    def run(autocast: bool):
        xs = [a.clone().requires_grad_() for a in args]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o, _ = fn(*xs, **kwargs)
            grads = torch.autograd.grad(o.float().square().sum(), xs)
        return o, grads

    o_ref, g_ref = run(False)
    o, g = run(True)
    assert o.dtype == torch.float32
    errors = [rel_err(o, o_ref.double())] + [rel_err(a, b.double()) for a, b in zip(g, g_ref)]
    assert max(errors) < 1e-6, errors
