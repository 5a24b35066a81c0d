"""The gate activation of FLA's ``use_gate_in_kernel=True`` as one autograd node that keeps only its
raw input: KDA / GDN2's per-channel gate (``vector_gate``) and GDN's scalar gate per value head
(``scalar_gate``, the same node on a channel axis of one).

``-exp(A_log[h]) * softplus(g + dt_bias[h])``, or with ``lower_bound``
``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))``: the formulas of
``reference.kda_gate``. Written as plain torch ops, autograd would keep two
float32 copies of the gate's size for the backward (the softplus input and
output, 8 bytes per gate element), where FLA's fused kernel keeps its raw
16-bit input. This node keeps the raw ``g`` (a tensor the caller's projection
made anyway) and recomputes the activation's derivative in the backward. With
``x = g + dt_bias``:

- softplus form, ``out = -e^A softplus(x)``: ``d out / dx = -e^A sigmoid(x)``,
  ``d out / dA = out``;
- bounded form, ``y = e^A x``, ``out = lb sigmoid(y)``: ``d out / dy =
  lb s (1 - s)`` with ``s = sigmoid(y)``, ``d out / dx = e^A d out / dy``,
  ``d out / dA = y d out / dy``.

dt_bias's gradient is the sum of dx over every position, A_log's the sum of
``dout * d out / dA`` over every position and channel of its head. Everything
is computed in ``dtype`` (float32, or float64 for float64 inputs) and the
gradients return in each input's dtype.
"""

from __future__ import annotations

import torch


def _pre(g, A_log, dt_bias, dtype):
    """x = g + dt_bias and the per-head factor e^A ([H, 1], or None), in ``dtype``."""
    H = g.shape[-2]
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(H, -1)
    scale = None if A_log is None else A_log.to(dtype).reshape(H, 1).exp()
    return x, scale


class VectorGateActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, A_log, dt_bias, lower_bound, dtype):
        x, scale = _pre(g, A_log, dt_bias, dtype)
        if lower_bound is None:
            out = -scale * torch.nn.functional.softplus(x)
        else:
            out = lower_bound * torch.sigmoid(x if scale is None else scale * x)
        ctx.save_for_backward(g, A_log, dt_bias)
        ctx.lower_bound, ctx.dtype = lower_bound, dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        g, A_log, dt_bias = ctx.saved_tensors
        lower_bound, dtype = ctx.lower_bound, ctx.dtype
        x, scale = _pre(g, A_log, dt_bias, dtype)
        dout = dout.to(dtype)
        if lower_bound is None:
            dx = dout * (-scale * torch.sigmoid(x))
            da_terms = dout * (-scale * torch.nn.functional.softplus(x))      # dout * out
        else:
            y = x if scale is None else scale * x
            s = torch.sigmoid(y)
            dy = dout * (lower_bound * s * (1 - s))
            dx = dy if scale is None else dy * scale
            da_terms = dy * y
        H, K = g.shape[-2], g.shape[-1]
        dg = dx.to(g.dtype) if ctx.needs_input_grad[0] else None
        dA = None
        if A_log is not None and ctx.needs_input_grad[1]:
            dA = da_terms.reshape(-1, H, K).sum((0, 2)).reshape(A_log.shape).to(A_log.dtype)
        ddt = None
        if dt_bias is not None and ctx.needs_input_grad[2]:
            ddt = dx.reshape(-1, H, K).sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
        return dg, dA, ddt, None, None


def vector_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                lower_bound: float | None, dtype: torch.dtype) -> torch.Tensor:
    """The activated gate [..., H, K] in ``dtype`` (see the module docstring); A_log has H elements,
    dt_bias H * K; A_log may be None only with ``lower_bound``."""
    if lower_bound is None and A_log is None:
        raise ValueError("vector_gate: A_log is required when lower_bound is None.")
    return VectorGateActivation.apply(g, A_log, dt_bias, lower_bound, dtype)


def scalar_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """GDN's activated gate [..., HV] in ``dtype``: ``-exp(A_log) * softplus(g + dt_bias)`` with A_log and
    dt_bias of HV elements, as one node keeping the raw g (plain torch ops keep two float32 copies of
    the gate's size)."""
    return vector_gate(g.unsqueeze(-1), A_log, dt_bias, None, dtype).squeeze(-1)
