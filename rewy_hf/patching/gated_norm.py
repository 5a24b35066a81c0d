"""The gated RMSNorm after a patched layer's core, on FLA's fused kernel in eager CUDA calls.

transformers' delta-rule layers (Qwen3.5, Qwen3-Next, OLMo-hybrid, Kimi-Linear and their kin)
normalise the core's output and multiply it by an activated gate in a ``*RMSNormGated`` module of
plain torch: about ten float32 elementwise kernels forward and more backward, each a pass over a
[tokens x value width] tensor, with float32 copies of it kept for the backward. FLA's
``rms_norm_gated`` computes the same function (the norm and the gate's SiLU or sigmoid in float32,
one rounding at the end) in one kernel each way. Where transformers' formula rounds the normalised
value to the input's dtype before the weight (the Qwen family), the fused kernel keeps float32:
the same sum, a rounding fewer.

A patched layer's gated norm gets an instance-level ``forward`` that takes the fused kernel for
eager CUDA calls and runs the module's own forward otherwise (CPU, or traced by torch.compile,
where inductor fuses the torch form itself). Bound at ``patch_model``, removed at
``unpatch_model``. A norm whose forward is not its class's own (a hub kernel mapped by
``kernelize``, or an instance-level forward of someone else, such as Accelerate's device hooks)
is left as it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .dispatch import count_forward

NORM_OP = "gated_norm"          # its entry in the dispatch report
ACTIVATIONS = ("silu", "swish", "sigmoid")


def gated_norms(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The direct children of ``layer`` that are its modeling module's gated RMSNorm, with the
    attributes the fused kernel needs and the class's own forward."""
    found = []
    for name, child in layer.named_children():
        kind = type(child)
        if not (kind.__name__.endswith("RMSNormGated") and kind.__module__ == type(layer).__module__):
            continue
        if getattr(kind.forward, "__module__", None) != kind.__module__ or "forward" in child.__dict__:
            continue
        weight = getattr(child, "weight", None)
        if not (isinstance(weight, nn.Parameter) and weight.dim() == 1):
            continue
        if getattr(child, "activation", None) not in ACTIVATIONS or not isinstance(
                getattr(child, "variance_epsilon", None), float):
            continue
        found.append((name, child))
    return found


def bind_gated_norms(layer: nn.Module) -> tuple[str, ...]:
    """Give each gated norm of ``layer`` the routed forward; the names of those bound."""
    bound = []
    for name, norm in gated_norms(layer):
        norm.forward = RoutedForward(norm)
        bound.append(name)
    return tuple(bound)


def unbind_gated_norms(layer: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        norm = getattr(layer, name, None)
        if norm is not None and isinstance(norm.__dict__.get("forward"), RoutedForward):
            del norm.__dict__["forward"]


def fused_gated_rms_norm(norm: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``norm``'s function on FLA's fused kernel: ``weight * x / rms(x) * act(gate)``, float32 inside."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(hidden_states, gate, norm.weight, None, activation=norm.activation,
                          eps=norm.variance_epsilon)


class RoutedForward:
    """A bound gated norm's forward: the fused kernel for eager CUDA calls, the class's own forward
    for the rest. An object rather than a bound method, so that a pickled or deep-copied model
    carries it, pointing at its own copy of the norm."""

    def __init__(self, norm: nn.Module):
        self.norm = norm

    def __call__(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        norm = self.norm
        if (gate is None or not hidden_states.is_cuda or torch.compiler.is_compiling()
                or gate.shape != hidden_states.shape):
            return type(norm).forward(norm, hidden_states, gate)
        count_forward(NORM_OP, "fla-triton", "-", "in place of the torch norm")
        return fused_gated_rms_norm(norm, hidden_states, gate)
