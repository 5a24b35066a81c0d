"""After a configuration's first packed call no packing builds or tunes a kernel (GPU only):
kernels/triton_backend/packed_builds.py runs every build packings of the same tokens need at
that call, so a long packed run never stops at a step for Triton."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.bench.triton_builds import built_and_tuned

pytestmark = pytest.mark.gpu

T, H, K, V = 4096, 4, 128, 128      # 4 heads: one document walks narrow, nine fill half the SMs


def _step(op, bounds, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(1, T, H, K).bfloat16(), F.normalize(r(1, T, H, K), dim=-1).bfloat16(), r(1, T, H, V).bfloat16()
    gate = F.logsigmoid(r(1, T, H, K) if op == "kda" else r(1, T, H))
    beta = torch.rand(1, T, H, device="cuda", generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, gate, beta)]
    fn = rewy_hf.chunk_kda if op == "kda" else rewy_hf.chunk_gated_delta_rule
    o, _ = fn(*leaves, cu_seqlens=torch.tensor(bounds, device="cuda"), backend="triton")
    grads = torch.autograd.grad((o.float() * r(*o.shape)).sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


def _bounds(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    assert out[-1] == T
    return out


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_no_packing_builds_or_tunes_after_the_first_packed_call(op):
    rng = random.Random(3)
    _step(op, _bounds([700, 1100, 45, 900, 1000, 351]), seed=0)
    torch.cuda.synchronize()
    before = built_and_tuned()
    tail = []
    while sum(tail) < T:
        tail.append(min(T - sum(tail), int(rng.paretovariate(1.2) * 60)))
    for i, lengths in enumerate([[T], [3000, 1096], [64] * 64, tail, [37] * 110 + [T - 37 * 110],
                                 [2048, 2048], [5, T - 5]]):
        _step(op, _bounds(lengths), seed=i + 1)
    torch.cuda.synchronize()
    assert built_and_tuned() == before
