"""Gate gradients under strong decay, and a hard reset (log-gate -inf), torch backend, float32.

With a log-gate near -10 per token a chunk's cumulative gate reaches about
-640, and the true gate gradient is made of terms e^-10 apart. A gate
gradient formed as the difference of large terms (a Gram's diagonal entering
and leaving, or the last key's decay added and taken away again) loses it all
to rounding: before the fix `dg` was 9e-3 off at -10 and 1e2 at -20 against
the float64 recurrence. The bounds below are what float32 leaves (the
cumulative gate's own rounding, about 1e-5 relative at -20).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rewy_hf.ops import chunk_gated_delta_rule, chunk_gdn2, chunk_kda
from rewy_hf.kernels.reference import naive_gated_delta_rule, naive_gdn2, naive_kda
from rewy_hf.rel_error import rel_err

B, T, H, K, V = 1, 192, 2, 16, 16
OPS = {"gdn": (chunk_gated_delta_rule, naive_gated_delta_rule),
       "kda": (chunk_kda, naive_kda),
       "gdn2": (chunk_gdn2, naive_gdn2)}


def inputs(op: str, log_gate: float, reset_at: int | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen) * 0.9 + 0.05  # noqa: E731
    gate_shape = (B, T, H) if op == "gdn" else (B, T, H, K)
    g = log_gate + 0.1 * r(*gate_shape).clamp(-1, 1)
    if reset_at is not None:
        g[:, reset_at] = float("-inf")
    xs = [r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V), g]
    xs += [u(B, T, H, K), u(B, T, H, V)] if op == "gdn2" else [u(B, T, H)]
    return xs, r(B, T, H, V)


def errors(op: str, log_gate: float, reset_at: int | None = None) -> dict:
    fn, naive = OPS[op]
    xs, do = inputs(op, log_gate, reset_at)
    mine = [x.clone().requires_grad_() for x in xs]
    ref = [x.double().requires_grad_() for x in xs]
    o, _ = fn(*mine, backend="torch")
    ro, _ = naive(*ref)
    (o * do).sum().backward()
    (ro * do.double()).sum().backward()
    out = {"o": rel_err(o, ro)}
    out.update({f"d{i}": rel_err(a.grad, b.grad) for i, (a, b) in enumerate(zip(mine, ref))})
    return out


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("log_gate", [-5.0, -10.0, -20.0])
def test_gate_gradient_keeps_float32_accuracy_under_strong_decay(op, log_gate):
    err = errors(op, log_gate)
    # q, k, v and the output keep plain float32 accuracy; the gates' gradients (g, and GDN2's
    # per-channel erase gate b, whose products carry e^{G_i - G_j}) the cumulative gate's rounding
    assert max(err[x] for x in ("o", "d0", "d1", "d2")) < 2e-6, err
    assert max(v for x, v in err.items() if x not in ("o", "d0", "d1", "d2")) < 1e-4, err


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("reset_at", [0, 100, 127])   # first token, inside a chunk, a chunk's last token
def test_a_log_gate_of_minus_inf_resets_the_state_without_nan(op, reset_at):
    err = errors(op, -0.1, reset_at)
    assert all(v < 1e-5 for v in err.values()), err
