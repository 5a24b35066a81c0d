"""Random inputs for the four ops, shared by `rewy-hf bench`, `rewy-hf verify` and `rewy-hf demo`.

Ops go by their delta-rule family here (``delta_rule``, ``gdn``, ``kda``,
``gdn2``; kernels/vocabulary.py); each maps to its public op (``REWY_OPS``)
and to the name it has in the dispatch report and in
``REWY_HF_TEST_FAULT=...@<op>`` (``DISPATCH_NAME``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import ops
# The vocabulary's own objects, under the names the bench and the checks read (op -> report name).
from .kernels.vocabulary import FAMILIES as OPS
from .kernels.vocabulary import PUBLIC_OPS
from .kernels.vocabulary import REPORT_OPS as DISPATCH_NAME

# A dict the bench looks ops up in at call time (its tests swap an entry).
REWY_OPS = {op: getattr(ops, PUBLIC_OPS[op]) for op in OPS}
# The inputs with a gradient, in argument order: q, k, v and the op's own (rewy_hf/ops.py SPECS).
GRAD_NAMES = {op: ("q", "k", "v") + tuple(x.argument for x in ops.SPECS[op].inputs) for op in OPS}

# Gates near FLA's safe lower bound: g = LOWER_BOUND * sigmoid(x + 3), inside
# (-5, 0) and mostly near -4.8 per token, as a layer with use_gate_in_kernel
# and lower_bound = -5 (FLA's safe_gate range) produces when its gate
# saturates. Only the vector-gated ops have such a bound.
BOUND_OPS = tuple(op for op in OPS if ops.SPECS[op].gate_kind == "vector")
LOWER_BOUND = -5.0

# Strong decay for the scalar-gated op: a log-gate of STRONG_DECAY per token
# (plus noise of at most 0.1), as heads with a large A in GDN's
# g = -exp(A_log) * softplus(.) produce. Within a chunk the cumulative gate
# then reaches about -640, and the gate gradient is the sum of terms that
# differ by e^-10 per token, the regime where cancellation would show.
STRONG_OPS = ("gdn",)
STRONG_DECAY = -10.0


@dataclass(frozen=True)
class Shape:
    """B, T, H, K, V; ``N`` > 0: one row (B = 1) of T tokens packed from N sequences, passed as
    ``cu_seqlens`` (sequence n has a length proportional to n + 1, so the lengths differ)."""
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int = 0

    @property
    def label(self) -> str:
        return (f"{self.B},{self.T},{self.H}" + ("" if self.K == self.V == 128 else f",{self.K},{self.V}")
                + (f",packed={self.N}" if self.N else ""))

    def with_T(self, T: int) -> "Shape":
        return Shape(self.B, T, self.H, self.K, self.V, self.N)

    def packing(self, device) -> dict:
        """The ops' packing keyword (``cu_seqlens``), or {} for dense rows."""
        if not self.N:
            return {}
        total = self.N * (self.N + 1) // 2
        bounds = [self.T * (n * (n + 1) // 2) // total for n in range(self.N + 1)]
        return {"cu_seqlens": torch.tensor(bounds, dtype=torch.long, device=device)}


def make_inputs(op: str, s: Shape, device: str, qkv_dtype: torch.dtype, seed: int, gates: str = "logsigmoid"):
    """Op inputs in FLA's argument order, and an output gradient. ``gates``: "logsigmoid",
    "bound" (KDA / GDN2 only) for gates near the safe lower bound (see BOUND_OPS), or "strong"
    (GDN only) for strong decay (see STRONG_OPS)."""
    if gates == "bound" and op not in BOUND_OPS:
        raise ValueError(f"gates at the safe lower bound are a check of {', '.join(BOUND_OPS)}, not of {op}")
    if gates == "strong" and op not in STRONG_OPS:
        raise ValueError(f"the strong-decay gates are a check of {', '.join(STRONG_OPS)}, not of {op}")
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, device=device, generator=gen)  # noqa: E731
    u = lambda *shape: torch.rand(*shape, device=device, generator=gen)   # noqa: E731
    if gates == "bound":
        gate = lambda *shape: LOWER_BOUND * torch.sigmoid(r(*shape) + 3.0)  # noqa: E731
    elif gates == "strong":
        gate = lambda *shape: STRONG_DECAY + 0.1 * r(*shape).clamp(-1, 1)  # noqa: E731
    else:
        gate = lambda *shape: F.logsigmoid(r(*shape))                       # noqa: E731
    B, T, H, K, V = s.B, s.T, s.H, s.K, s.V
    qkv = [r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)]
    # As FLA's layers hand them to the op: log-gates in float32 (computed in
    # float32 there), write strengths (beta, b, w) in the model dtype.
    if op == "delta_rule":
        gate_inputs, strengths = [], [u(B, T, H)]
    elif op == "gdn":
        gate_inputs, strengths = [gate(B, T, H)], [u(B, T, H)]
    elif op == "kda":
        gate_inputs, strengths = [gate(B, T, H, K)], [u(B, T, H)]
    else:
        gate_inputs, strengths = [gate(B, T, H, K)], [u(B, T, H, K), u(B, T, H, V)]
    do = r(B, T, H, V).to(qkv_dtype)
    return [x.to(qkv_dtype) for x in qkv] + gate_inputs + [x.to(qkv_dtype) for x in strengths], do


def float64_inputs(op: str, gen: torch.Generator, shape: Shape):
    """float64 op inputs (leaves that require grad) and an initial state, for checks against the
    float64 recurrence; ``op`` is a public op name (``chunk_kda``, ...)."""
    B, T, H, K, V = shape.B, shape.T, shape.H, shape.K, shape.V
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)   # noqa: E731
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    if op == "chunk_delta_rule":
        args = [q, k, v, u(B, T, H)]
    elif op == "chunk_gated_delta_rule":
        args = [q, k, v, F.logsigmoid(r(B, T, H)), u(B, T, H)]
    elif op == "chunk_kda":
        args = [q, k, v, F.logsigmoid(r(B, T, H, K)), u(B, T, H)]
    else:
        args = [q, k, v, F.logsigmoid(r(B, T, H, K)), u(B, T, H, K), u(B, T, H, V)]
    return [a.requires_grad_() for a in args], 0.5 * r(B, H, K, V)
