"""GDN2's short convolutions on the CPU in plain torch.

FLA's ``ShortConvolution`` has Triton and CUDA kernels only, so on a machine
without a GPU its Triton kernel runs in the interpreter: about 60 % of a
training step of the tiny GDN2 preset. The same depthwise causal convolution
(float32 sum, activation before the one rounding, as FLA's kernel does) is a
few multiply-adds on shifted views in torch (``kernels/short_conv.py``).

:class:`CpuTorchShortConvolution` is FLA's module with that one change: a call
on CPU tensors that carries no cache, no final state, no residual and no
packed bounds runs the torch form; every other call, and every call on a GPU,
runs FLA's own forward. The parameters (and so checkpoints) are FLA's.
"""

from __future__ import annotations

import torch
from fla.modules import ShortConvolution
from torch import nn

from ...kernels.short_conv import causal_short_conv


class CpuTorchShortConvolution(ShortConvolution):
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


def use_torch_convolutions_on_cpu(layer: nn.Module) -> None:
    """Make ``layer``'s FLA short convolutions :class:`CpuTorchShortConvolution` (same parameters)."""
    for module in layer.modules():
        if type(module) is ShortConvolution:
            module.__class__ = CpuTorchShortConvolution
