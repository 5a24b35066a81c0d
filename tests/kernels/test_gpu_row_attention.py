"""The attention of a context-parallel hybrid (kernels/context_parallel_attention.py) on a GPU: the
SDPA calls per sequence piece, including those whose sequence began before the slice (causal from
the bottom right, which SDPA serves with its flash or memory-efficient kernels depending on the head
dims), against one float32 softmax over the whole row with an explicit mask, in bf16 and at the head
dims of the hybrids served (equal q / k / v dims as in Qwen3.5, or MLA's wider keys as in Kimi-Linear)."""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.context_parallel_attention import _attend_pieces, sequence_pieces
from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu


def _reference(query, keys, values, bounds, lo, scaling):
    """float32 softmax attention of this slice's queries over the whole row, each query seeing the
    keys of its own sequence up to itself."""
    P, T = query.shape[2], keys.shape[2]
    seq = torch.bucketize(torch.arange(T), torch.tensor(bounds[1:-1]), right=True)
    pos = torch.arange(T)
    qpos = pos[lo:lo + P]
    mask = (seq[lo:lo + P, None] == seq[None, :]) & (pos[None, :] <= qpos[:, None])
    groups = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(groups, dim=1)
    v = values.float().repeat_interleave(groups, dim=1)
    s = (query.float() @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~mask.to(s.device), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,dqk,dv", [(4, 4, 16, 16), (4, 4, 24, 16), (4, 2, 64, 64), (2, 2, 192, 128)])
@pytest.mark.parametrize("bounds,lo", [([0, 254, 512], 256), ([0, 300, 512], 256), ([0, 100, 200, 512], 256)])
def test_pieces_match_one_masked_softmax(heads, kv_heads, dqk, dv, bounds, lo):
    g = torch.Generator(device="cuda").manual_seed(0)
    T, P = bounds[-1], 256
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    query, keys, values = r(1, heads, P, dqk), r(1, kv_heads, T, dqk), r(1, kv_heads, T, dv)
    scaling = dqk ** -0.5
    pieces = sequence_pieces(bounds, lo, lo + P)
    out = _attend_pieces(query, keys, values, pieces, lo, 0.0, scaling)
    ref = _reference(query, keys, values, bounds, lo, scaling)
    assert out.shape == ref.shape
    assert rel_err(out.float(), ref) < 1e-2

    # the backward, as the op's backward takes it (torch.func.vjp)
    do = r(*out.shape)
    _, pull = torch.func.vjp(lambda q, k, v: _attend_pieces(q, k, v, pieces, lo, 0.0, scaling), query, keys, values)
    mine = pull(do)
    qf, kf, vf = (x.float().requires_grad_() for x in (query, keys, values))
    theirs = torch.autograd.grad(_reference(qf, kf, vf, bounds, lo, scaling), (qf, kf, vf), do.float())
    for name, a, b in zip(("dq", "dk", "dv"), mine, theirs):
        assert rel_err(a.float(), b) < 2e-2, name
