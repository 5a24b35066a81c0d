"""The parts of a patched transformers layer around its core that rewy runs as fused work eagerly:
the gated output norm and Kimi-Linear's forget gate.

transformers' delta-rule layers (Qwen3.5, Qwen3-Next, OLMo-hybrid, Kimi-Linear and their kin)
normalise the core's output and multiply it by an activated gate in a ``*RMSNormGated`` module of
plain torch: about ten float32 elementwise kernels forward and more backward, each a pass over a
[tokens x value width] tensor, with float32 copies of it kept for the backward. FLA's
``rms_norm_gated`` computes the same function (the norm and the gate's SiLU or sigmoid in float32,
one rounding at the end) in one kernel each way, for eager CUDA calls. Where transformers' formula
rounds the normalised value to the input's dtype before the weight (the Qwen family), the fused
kernel keeps float32: the same sum, a rounding fewer.

Kimi-Linear's ``KimiLinearForgetGate`` activates its per-channel gate, ``-exp(A_log) *
softplus(g + dt_bias)``, as plain torch ops that keep three float32 copies of the gate's size for
the backward; rewy's ``vector_gate`` node (kernels/gate_activation.py) computes the same values and
keeps only the raw 16-bit projection, for eager CUDA calls.

Each part gets an instance-level ``forward`` (``RoutedForward``), bound at ``patch_model`` and
removed at ``unpatch_model``; traced by torch.compile, the module's own forward runs, since
inductor fuses the torch form itself. A module whose forward is not its class's own (a hub kernel
that ``kernelize`` mapped onto the class, or an instance-level forward of someone else, such as
Accelerate's device hooks) is left as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..kernels.gate_activation import vector_gate
from .dispatch import count_forward

NORM_OP = "gated_norm"              # the dispatch report's entries
GATE_OP = "forget_gate"
ACTIVATIONS = ("silu", "swish", "sigmoid")


def _own_forward(layer: nn.Module, child: nn.Module, suffix: str) -> bool:
    """Whether ``child`` is a ``*<suffix>`` module of ``layer``'s modeling module running its class's
    own forward."""
    kind = type(child)
    return (kind.__name__.endswith(suffix) and kind.__module__ == type(layer).__module__
            and getattr(kind.forward, "__module__", None) == kind.__module__ and "forward" not in child.__dict__)


def is_gated_norm(layer: nn.Module, child: nn.Module) -> bool:
    """A gated RMSNorm with the attributes the fused kernel reads."""
    weight = getattr(child, "weight", None)
    return (_own_forward(layer, child, "RMSNormGated") and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and getattr(child, "activation", None) in ACTIVATIONS
            and isinstance(getattr(child, "variance_epsilon", None), float))


def is_forget_gate(layer: nn.Module, child: nn.Module) -> bool:
    """Kimi-Linear's forget gate: the unbounded softplus form with one A_log per head (its kin with a
    lower bound or a reshaped A_log compute another formula and keep their own forward)."""
    return (type(child).__name__ == "KimiLinearForgetGate" and _own_forward(layer, child, "ForgetGate")
            and all(hasattr(child, a) for a in ("f_a_proj", "f_b_proj", "dt_bias", "A_log", "head_dim", "num_heads",
                                                "qkv_dim"))
            and child.A_log.numel() == child.num_heads and child.dt_bias.numel() == child.qkv_dim)


def fused_gated_rms_norm(norm: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``norm``'s function on FLA's fused kernel: ``weight * x / rms(x) * act(gate)``, float32 inside."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(hidden_states, gate, norm.weight, None, activation=norm.activation,
                          eps=norm.variance_epsilon)


def _norm(norm: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
    if gate is None or gate.shape != hidden_states.shape:
        return type(norm).forward(norm, hidden_states, gate)
    count_forward(NORM_OP, "fla-triton", "-", "in place of the torch norm")
    return fused_gated_rms_norm(norm, hidden_states, gate)


def forget_gate(gate: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear's forget gate [B, T, H, K] in float32, its activation as one node keeping the raw
    projection."""
    g = gate.f_b_proj(gate.f_a_proj(hidden_states)).unflatten(-1, (-1, gate.head_dim))
    return vector_gate(g, gate.A_log, gate.dt_bias, None, torch.float32)


def _gate(gate: nn.Module, hidden_states: torch.Tensor):
    count_forward(GATE_OP, "rewy", "-", "activation as one node")
    return forget_gate(gate, hidden_states)


# (what the part is, how it runs when bound)
PARTS: tuple[tuple[Callable[[nn.Module, nn.Module], bool], Callable], ...] = (
    (is_gated_norm, _norm), (is_forget_gate, _gate))


class RoutedForward:
    """A bound part's forward: rewy's form for eager CUDA calls, the class's own forward otherwise.
    Traced, inductor fuses the torch form itself; on the CPU the torch form stays, since the forget
    gate's float32 arithmetic differs from the module's in rounding order, which a float64 parity
    check of the whole model would see. An object rather than a bound method, so that a pickled or
    deep-copied model carries it, pointing at its own copy of the module."""

    def __init__(self, module: nn.Module, run: Callable):
        self.module, self.run = module, run

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling() or not hidden_states.is_cuda:
            return type(self.module).forward(self.module, hidden_states, *args, **kwargs)
        return self.run(self.module, hidden_states, *args, **kwargs)


def layer_parts(layer: nn.Module) -> list[tuple[str, nn.Module, Callable]]:
    """The direct children of ``layer`` that rewy runs in its own form, with that form."""
    return [(name, child, run) for name, child in layer.named_children()
            for found, run in PARTS if found(layer, child)]


def bind_layer_parts(layer: nn.Module) -> tuple[str, ...]:
    """Give each part of ``layer`` its routed forward; the names of those bound."""
    for _, child, run in (parts := layer_parts(layer)):
        child.forward = RoutedForward(child, run)
    return tuple(name for name, _, _ in parts)


def unbind_layer_parts(layer: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        child = getattr(layer, name, None)
        if child is not None and isinstance(child.__dict__.get("forward"), RoutedForward):
            del child.__dict__["forward"]
