"""GDN2's FLA building blocks on the CPU in plain torch.

Three of the FLA modules a GDN2 block is made of have Triton kernels only: the
short convolution, the gated output norm and the MLP's SwiGLU. On a machine
without a GPU those kernels run in the Triton interpreter, about 90 % of a
training step of the tiny GDN2 preset. Each subclass here computes its
module's value in plain torch for the calls it covers on CPU tensors, in float32
with one rounding at the end as FLA's kernels do, and runs FLA's own forward
for every other call and for every call on a GPU. They add no parameters, so
checkpoints are FLA's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fla.modules import FusedRMSNormGated, GatedMLP, ShortConvolution
from torch import nn

from ...kernels.short_conv import causal_short_conv


class CpuTorchShortConvolution(ShortConvolution):
    """A depthwise causal convolution over shifted views (``kernels/short_conv.py``); cached, final-state,
    residual, packed and context-parallel calls stay FLA's."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.LongTensor | None = None, **kwargs):
        if x.device.type != "cpu" or cache is not None or output_final_state or residual is not None \
                or cu_seqlens is not None or kwargs.get("cp_context") is not None:
            return super().forward(x, residual=residual, mask=mask, cache=cache,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)
        if mask is not None:
            x = x * mask.unsqueeze(-1).to(x.dtype)
        y = causal_short_conv(x.transpose(1, 2), self.weight[:, 0], self.bias, self.activation)
        return y.transpose(1, 2), None


class CpuTorchRMSNormGated(FusedRMSNormGated):
    """``rms_norm(x) * weight * act(g)``, act ``g * sigmoid(g)`` (swish / silu) or ``sigmoid(g)``;
    calls with a residual or ``prenorm`` stay FLA's."""

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False):
        if x.device.type != "cpu" or residual is not None or prenorm:
            return super().forward(x, g, residual=residual, prenorm=prenorm, residual_in_fp32=residual_in_fp32)
        xf, gf = x.float(), g.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        gate = torch.sigmoid(gf) if self.activation == "sigmoid" else gf * torch.sigmoid(gf)
        return (y * gate).to(x.dtype)


class CpuTorchGatedMLP(GatedMLP):
    """``down(silu(gate(x)) * up(x))``, the product in float32; other activations stay FLA's."""

    def forward(self, x: torch.Tensor, **kwargs):
        if x.device.type != "cpu" or self.hidden_act != "swish":
            return super().forward(x, **kwargs)
        gate, y = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((F.silu(gate.float()) * y.float()).to(gate.dtype))


_CPU_FORMS = {ShortConvolution: CpuTorchShortConvolution, FusedRMSNormGated: CpuTorchRMSNormGated,
              GatedMLP: CpuTorchGatedMLP}


def use_torch_forms_on_cpu(module: nn.Module) -> None:
    """Give every FLA short convolution, gated norm and gated MLP inside ``module`` its CPU form
    (the same parameters: only the class changes)."""
    for m in module.modules():
        form = _CPU_FORMS.get(type(m))
        if form is not None:
            m.__class__ = form
