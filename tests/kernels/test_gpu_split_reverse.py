"""The split reverse pass (triton_backend/split_reverse.py) on CUDA (GPU only).

BF16 inputs. Through the public ops, every family with its reverse pass split into two-chunk
segments must match the fp32 torch backend and be no less accurate (within 10 %, plus a small
floor) than the same op with the sequential walk; and the pass alone, on one 16384-token row,
must give the sequential walk's dh, dh0 and dv2 to bf16 accuracy, for rewy's walk (GDN) and
FLA's ``bwd_dhu`` (KDA's key-wise gate).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from op_grads import outputs_and_grads

import rewy_hf
from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu


def _op_inputs(op, B, T, H, K, V, N, gen):
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(B, T, H, K).bfloat16(), F.normalize(r(B, T, H, K), dim=-1).bfloat16(), r(B, T, H, V).bfloat16()
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    if op == "delta_rule":
        return rewy_hf.chunk_delta_rule, [q, k, v, beta]
    if op == "gdn":
        return rewy_hf.chunk_gated_delta_rule, [q, k, v, F.logsigmoid(r(B, T, H)), beta]
    g = F.logsigmoid(r(B, T, H, K))
    if op == "kda":
        return rewy_hf.chunk_kda, [q, k, v, g, beta]
    return rewy_hf.chunk_gdn2, [q, k, v, g, torch.rand(B, T, H, K, device="cuda", generator=gen).bfloat16(),
                                torch.rand(B, T, H, V, device="cuda", generator=gen).bfloat16()]


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op,packed", [("gdn", False), ("gdn", True), ("delta_rule", False), ("kda", False),
                                       ("kda", True), ("gdn2", False)])
def test_split_pass_matches_fp32_reference_and_the_sequential_walk(op, packed, policy):
    from rewy_hf.kernels.triton_backend import split_reverse

    gen = torch.Generator(device="cuda").manual_seed(5)
    B, T, H, K, V = (1, 1100, 2, 128, 128) if packed else (2, 700, 2, 128, 128)
    N = 3 if packed else B
    fn, args = _op_inputs(op, B, T, H, K, V, N, gen)
    kw = dict(output_final_state=True, initial_state=0.3 * torch.randn(N, H, K, V, device="cuda", generator=gen))
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 130, 900, 1100], device="cuda")
    do = torch.randn(B, T, H, V, device="cuda", generator=gen)
    dht = torch.randn(N, H, K, V, device="cuda", generator=gen)
    ref = outputs_and_grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    errs, split = {}, []
    for mode in ("sequential", "split"):
        with pytest.MonkeyPatch.context() as mp:
            if mode == "sequential":
                mp.setattr(split_reverse, "plan", lambda *_: None)
            else:
                mp.setattr(split_reverse, "chunks_per_segment", lambda *_: 2)
                reverse = split_reverse.reverse
                mp.setattr(split_reverse, "reverse", lambda *a, **k: split.append(1) or reverse(*a, **k))
            ours = outputs_and_grads(lambda *a, **k: fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
        errs[mode] = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert split == [1]
    assert max(errs["split"]) < 2e-2, errs
    assert all(e <= 1.1 * s + 1e-3 for e, s in zip(errs["split"], errs["sequential"])), errs


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_split_pass_alone_matches_the_sequential_walk(op):
    """One 16384-token row of one head (256 chunks) in segments of 32 chunks, against the sequential
    walk on the same BF16 inputs."""
    from fla.ops.utils import chunk_local_cumsum

    from rewy_hf.kernels.triton_backend import segments, split_reverse, state_launch
    from rewy_hf.kernels.triton_backend.scalar_gate.reverse_walk import reverse_walk

    gen = torch.Generator(device="cuda").manual_seed(2)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    B, T, H, K, V = 1, 16384, 1, 128, 128
    scale = K ** -0.5
    inputs = dict(q=r(B, T, H, K).bfloat16(), k=F.normalize(r(B, T, H, K), dim=-1).bfloat16(),
                  w=(0.3 * F.normalize(r(B, T, H, K), dim=-1)).bfloat16())
    if op == "gdn":
        inputs["g"] = chunk_local_cumsum(F.logsigmoid(r(B, T, H)), chunk_size=64, scale=1.4426950408889634)
        walk = lambda state_v_first, **kw: reverse_walk(**kw, scale=scale)
    else:
        inputs["gk"] = chunk_local_cumsum(F.logsigmoid(r(B, T, H, K)), chunk_size=64, scale=1.4426950408889634)
        walk = lambda **kw: state_launch.bwd_dhu(**kw, scale=scale, chunk_size=64)
    do, dv = r(B, T, H, V).bfloat16(), r(B, T, H, V).bfloat16()
    dht, h0 = r(B, H, K, V), r(B, H, K, V)
    whole = walk(**inputs, do=do, dv=dv, h0=h0, dht=dht, state_v_first=False)
    seg = segments.cut(segments.row_bounds(B, T), 32, do.device)
    got = split_reverse.reverse(walk, seg, inputs, do, dv, dht, h0)
    for name, a, b in zip(("dh", "dh0", "dv2"), got, whole):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a.float(), b.float()) < 1e-2, name
