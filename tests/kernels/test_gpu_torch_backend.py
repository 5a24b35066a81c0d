"""The torch backend on CUDA: same float64 ground truth as on CPU (GPU only)."""

from __future__ import annotations

import pytest
import torch

import rewy_hf
from rewy_hf.kernels import reference

from op_cases import make_case

pytestmark = pytest.mark.gpu

OURS = {"delta_rule": rewy_hf.chunk_delta_rule, "gdn": rewy_hf.chunk_gated_delta_rule,
        "kda": rewy_hf.chunk_kda, "gdn2": rewy_hf.chunk_gdn2}
REF = {"delta_rule": reference.naive_delta_rule, "gdn": reference.naive_gated_delta_rule,
       "kda": reference.naive_kda, "gdn2": reference.naive_gdn2}


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op", list(OURS))
def test_cuda_matches_float64_recurrence(op, policy):
    gen = torch.Generator().manual_seed(0)
    args, kwargs, leaves = make_case(op, gen, T=150, h0=True, l2=True, cu=None)
    o_ref, ht_ref = REF[op](*args, **kwargs)
    cuda = lambda t: t.detach().cuda().requires_grad_()
    args_c = [cuda(a) for a in args]
    kwargs_c = {k: (cuda(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
    o, ht = OURS[op](*args_c, backend="torch", policy=policy, **kwargs_c)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + ht_ref.sum(), leaves)
    leaves_c = args_c + [kwargs_c["initial_state"]]
    grads = torch.autograd.grad((o * do.cuda()).sum() + ht.sum(), leaves_c)
    rel = lambda x, r: ((x.cpu() - r).norm() / r.norm()).item()
    errs = [rel(o, o_ref), rel(ht, ht_ref)] + [rel(g, gr) for g, gr in zip(grads, grads_ref)]
    assert max(errs) <= 1e-10, errs
