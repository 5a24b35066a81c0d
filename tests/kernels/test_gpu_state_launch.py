"""rewy's launch of FLA's sequential state recurrences at each value-block width (GPU only).

triton_backend/state_launch.py runs FLA's own fwd_h and bwd_dhu kernels itself, with a BV
that FLA's autotuner may not pick (16 is not among FLA's widths) or at FLA's own widths. Each
width computes the same products per value column, so every output must match FLA's stage
functions to float rounding (the bf16 outputs to a few units in their last place where the accumulation
order differs), and the ops' gradients with the width rule (on by default) must stay as
close to the fp32 reference as with FLA's launch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.kernels.triton_backend import state_launch
from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu

# (gate kind, V-first state layout, packed sequences)
CASES = [("gk", False, False), ("gk", True, False), ("g", False, False), ("gk", False, True)]


def _recurrence_inputs(gate, v_first, packed, seed=0):
    from fla.ops.utils import chunk_local_cumsum

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)    # noqa: E731
    lengths = [300, 64, 700] if packed else [1000]
    B, T, H, K, V = 1, sum(lengths), 2, 128, 128
    N = len(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0) if packed else None
    raw = r(B, T, H, K) if gate == "gk" else r(B, T, H)
    g = chunk_local_cumsum(F.logsigmoid(raw + 3), chunk_size=64, scale=1.4426950408889634, cu_seqlens=cu)
    state = (N, H, V, K) if v_first else (N, H, K, V)
    return dict(k=(0.5 * F.normalize(r(B, T, H, K), dim=-1)).bfloat16(), q=r(B, T, H, K).bfloat16(),
                w=(0.1 * r(B, T, H, K)).bfloat16(), u=r(B, T, H, V).bfloat16(), do=r(B, T, H, V).bfloat16(),
                dv=r(B, T, H, V).bfloat16(), h0=0.3 * r(*state), dht=0.3 * r(*state),
                g=g if gate == "g" else None, gk=g if gate == "gk" else None, cu=cu, v_first=v_first)


def _both(x, fla: bool = False):
    """The two recurrences launched by rewy, or by FLA's own stage functions."""
    from fla.ops.common import chunk_delta_h

    fwd_h = chunk_delta_h.chunk_gated_delta_rule_fwd_h if fla else state_launch.fwd_h
    bwd_dhu = chunk_delta_h.chunk_gated_delta_rule_bwd_dhu if fla else state_launch.bwd_dhu
    fwd = fwd_h(k=x["k"], w=x["w"], u=x["u"], g=x["g"], gk=x["gk"],
                             initial_state=x["h0"], output_final_state=True, state_v_first=x["v_first"],
                             cu_seqlens=x["cu"])
    bwd = bwd_dhu(q=x["q"], k=x["k"], w=x["w"], do=x["do"], dv=x["dv"], g=x["g"], gk=x["gk"], h0=x["h0"],
                  dht=x["dht"], scale=128 ** -0.5, state_v_first=x["v_first"], cu_seqlens=x["cu"])
    return dict(zip(("h", "v_new", "ht", "dh", "dh0", "dv2"), (*fwd, *bwd)))


@pytest.mark.parametrize("width", [None, 64, 32, 16])
@pytest.mark.parametrize("gate, v_first, packed", CASES)
def test_each_width_matches_flas_launch(monkeypatch, gate, v_first, packed, width):
    """None: FLA's kernel at the width its own autotuner picks, launched by rewy."""
    x = _recurrence_inputs(gate, v_first, packed)
    ref = _both(x, fla=True)
    monkeypatch.setattr(state_launch, "narrow_block_v", lambda *_: width)
    ours = _both(x)
    assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {n: (t.shape, t.dtype) for n, t in ref.items()}
    errs = {n: rel_err(ours[n], ref[n]) for n in ref}
    # float32 outputs (final state, dh0) to rounding; bf16 ones (h, v_new, dh, dv2) to a few flipped last bits
    assert errs["ht"] <= 1e-4 and errs["dh0"] <= 1e-4, errs
    assert max(errs.values()) <= 2e-3, errs


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_the_width_rule_keeps_the_ops_gradients(monkeypatch, op):
    """chunk_kda / chunk_gated_delta_rule (policy recompute, so both recurrences run in the
    backward) at a shape where the rule picks BV 16: gradients against the fp32 torch
    backend no worse than with FLA's launch (within 10 %, plus a small floor)."""
    B, T, H, K, V = 1, 1000, 2, 128, 128
    assert state_launch.narrow_block_v(B, H, V) == 16
    gen = torch.Generator(device="cuda").manual_seed(11)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)    # noqa: E731
    q, k, v = r(B, T, H, K).bfloat16(), F.normalize(r(B, T, H, K), dim=-1).bfloat16(), r(B, T, H, V).bfloat16()
    g = F.logsigmoid((r(B, T, H, K) if op == "kda" else r(B, T, H)) + 3)
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    args = [q, k, v, g, beta]
    fn = rewy_hf.chunk_kda if op == "kda" else rewy_hf.chunk_gated_delta_rule
    do, dht, h0 = r(B, T, H, V), r(B, H, K, V), 0.3 * r(B, H, K, V)

    def grads(leaves_in, **kw):
        leaves = [a.detach().requires_grad_() for a in [*leaves_in, h0]]
        o, ht = fn(*leaves[:-1], initial_state=leaves[-1], output_final_state=True, **kw)
        return torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves)

    ref = grads([a.float() for a in args], backend="torch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_launch, "narrow_block_v", lambda *_: None)      # FLA's widths
        with_fla = grads(args, backend="triton", policy="recompute")
    with_rule = grads(args, backend="triton", policy="recompute")
    errs = [rel_err(x, y) for x, y in zip(with_rule, ref)]
    fla_errs = [rel_err(x, y) for x, y in zip(with_fla, ref)]
    assert max(errs) < 2e-2 and all(e <= 1.1 * f + 1e-3 for e, f in zip(errs, fla_errs)), (errs, fla_errs)
