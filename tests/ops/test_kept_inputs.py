"""What the core keeps for its backward owns its storage: no view that keeps a larger buffer alive.

transformers' delta-rule layers (Qwen3.5, Qwen3-Next, Kimi-Linear) split q, k
and v out of one convolution output and hand the core views of it. The
backward keeps v (and q, k without the in-kernel l2norm); a kept view would
keep the whole buffer, q and k included, until the backward. FLA copies its
inputs dense, so with views kept a patched layer held more memory than the
unpatched one: at B x T = 8192 with 16 key and 32 value heads of 128 in bf16,
128 MB where FLA holds 64 MB.
"""

from __future__ import annotations

import pytest
import torch

from rewy_hf.op_inputs import OPS, REWY_OPS, Shape, make_inputs

SHAPE = Shape(B=1, T=80, H=2, K=16, V=16)


def _as_views(q, k, v):
    """q, k, v as views of one [B, T, 3 x H x D] buffer, as transformers' layers make them."""
    B, T, H, K = q.shape
    fused = torch.cat([x.reshape(B, T, -1) for x in (q, k, v)], dim=-1).detach().requires_grad_()
    views = [x.reshape(B, T, H, -1) for x in torch.split(fused, [q[0, 0].numel(), k[0, 0].numel(),
                                                                 v[0, 0].numel()], dim=-1)]
    return fused, views


def _core_node(out: torch.Tensor):
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node.name() == "CoreFunctionBackward":
            return node
        seen.add(node)
        stack += [fn for fn, _ in node.next_functions]
    raise AssertionError("no CoreFunctionBackward node behind the op's output")


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_the_core_keeps_no_view_of_a_larger_buffer(op, l2norm):
    args, do = make_inputs(op, SHAPE, "cpu", torch.float32, seed=0)
    fused, (q, k, v) = _as_views(*args[:3])
    assert all(not x.is_contiguous() for x in (q, k, v))
    rest = [a.detach().requires_grad_() for a in args[3:]]
    o, _ = REWY_OPS[op](q, k, v, *rest, use_qk_l2norm_in_kernel=l2norm, backend="torch")
    kept = [t for t in _core_node(o).saved_tensors if t is not None]
    assert len(kept) >= 3
    for t in kept:
        own = t.numel() * t.element_size()
        assert t.untyped_storage().nbytes() == own, (
            f"{op}: a kept {tuple(t.shape)} tensor holds {t.untyped_storage().nbytes()} bytes of storage for "
            f"its own {own}")

    # the same gradients as from dense inputs: keeping copies changes what is held, not what is computed
    (o * do).sum().backward()
    dense = [a.detach().clone().requires_grad_() for a in args]
    o2, _ = REWY_OPS[op](*dense, use_qk_l2norm_in_kernel=l2norm, backend="torch")
    (o2 * do).sum().backward()
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    B, T = SHAPE.B, SHAPE.T
    torch.testing.assert_close(fused.grad, torch.cat([x.grad.reshape(B, T, -1) for x in dense[:3]], dim=-1),
                               rtol=0, atol=0)
    for a, b in zip(rest, dense[3:]):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_a_view_kept_by_the_core_would_hold_the_whole_buffer():
    # the premise: a kept view holds its base's storage, three times v's bytes here
    args, _ = make_inputs("gdn", SHAPE, "cpu", torch.float32, seed=0)
    fused, (_, _, v) = _as_views(*args[:3])
    assert v.untyped_storage().nbytes() == 3 * v.numel() * v.element_size()


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_the_triton_core_keeps_dense_inputs_and_no_gate_values(op, monkeypatch):
    """As transformers' Qwen3.5 / Kimi-Linear layers call it: q, k, v views of one buffer, the
    l2norm inside, activated float32 gates. The Triton backward works from the gate's chunk cumsum,
    so the core keeps a one-element stand-in for the gate; everything else it keeps owns its storage.
    Under TRITON_INTERPRET=1, FLA's recurrences replaced by torch loops; the gradients are those of
    the same call on dense inputs, bit for bit."""
    from state_loops import replace_recurrences

    from rewy_hf.kernels import triton_entry

    replace_recurrences(monkeypatch)
    s = Shape(B=1, T=130, H=2, K=32, V=32)
    args, do = make_inputs(op, s, "cpu", torch.float32, seed=3)
    core = triton_entry.triton_gdn_core if op == "gdn" else triton_entry.triton_kda_core

    def run(q, k, v, g, beta):
        o, _ = core(q, k, v, g, beta, s.K ** -0.5, None, False, False, "recompute", qk_l2norm=True)
        return o

    fused, (q, k, v) = _as_views(*args[:3])
    g, beta = (a.detach().requires_grad_() for a in args[3:])
    o = run(q, k, v, g, beta)
    kept = [t for t in _core_node(o).saved_tensors if t is not None]
    stand_ins = [t for t in kept if t.untyped_storage().nbytes() == t.element_size()]
    assert [(t.shape, t.dtype) for t in stand_ins] == [(g.shape, g.dtype)]
    for t in kept:
        if t is not stand_ins[0]:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), tuple(t.shape)

    (o * do).sum().backward()
    dense = [a.detach().clone().requires_grad_() for a in args]
    o2 = run(*dense)
    (o2 * do).sum().backward()
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(fused.grad, torch.cat([x.grad.reshape(1, s.T, -1) for x in dense[:3]], dim=-1),
                               rtol=0, atol=0)
    torch.testing.assert_close(g.grad, dense[3].grad, rtol=0, atol=0)
    torch.testing.assert_close(beta.grad, dense[4].grad, rtol=0, atol=0)
