"""The torch backend's GDN / DeltaNet stages at small shapes, and the local-backward kernels' arguments
built from them in FLA's layout: the inputs and ground truth of the chunk-local backward kernels' tests."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rewy_hf.kernels.constants import CHUNK as C
from rewy_hf.kernels.torch_backend.chunk_backward import local_backward, reverse_state_pass
from rewy_hf.kernels.torch_backend.chunk_forward import ChunkInputs
from rewy_hf.kernels.torch_backend.function import forward_pass
from rewy_hf.kernels.torch_backend.layout import ChunkLayout


def to_fla(x: torch.Tensor, T: int) -> torch.Tensor:
    """[NT, N, H, C, D] -> [N, T, H, D] (dropping padded rows past T), as the op's layout maps back."""
    return ChunkLayout(x.shape[1], T, C, None, x.device).from_chunks(x).contiguous()


def stages(kind: str, N: int, H: int, HV: int, NT: int, K: int, V: int, T: int, seed: int,
           log_gate: float | None = None, dtype=torch.float32):
    """The torch backend's stages; ``log_gate``: per-token log-gates near this value (strong decay)
    instead of logsigmoid of a normal draw; ``dtype``: the stages' precision."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NT, N, HV, C)
    r = lambda d: torch.randn(*shape, d, generator=gen)
    valid = (torch.arange(NT * C) < T).view(NT, 1, 1, C, 1).float()      # zero padding past T, as the layout does
    qk = lambda: F.normalize(torch.randn(NT, N, H, C, K, generator=gen), dim=-1).repeat_interleave(HV // H, dim=2)
    q, k = qk() * valid, qk() * valid
    v = r(V) * valid
    gate = F.logsigmoid(r(1)) if log_gate is None else log_gate + 0.1 * r(1).clamp(-1, 1)
    g = gate * valid if kind == "gdn" else torch.zeros(*shape, 1)
    b = torch.rand(*shape, 1, generator=gen) * valid
    cast = lambda t: t.to(dtype)  # noqa: E731
    x = ChunkInputs(cast(q), cast(k), cast(v), cast(g), cast(b), None, scale=K ** -0.5)
    h0 = cast(torch.randn(N, HV, K, V, generator=gen) * 0.3)
    gt, s, _ = forward_pass(x, h0)
    do = cast(r(V) * valid)
    dht = cast(torch.randn(N, HV, K, V, generator=gen) * 0.3)
    dVn, dHnext, _ = reverse_state_pass(x, gt, s, do, dht)
    ref = local_backward(x, gt, s, do, dVn, dHnext)
    return x, gt, s, do, dVn, dHnext, ref


def as_float32(inputs: dict) -> dict:
    """The kernels' arguments in float32 (the interpreter's tl.dot is wrong for bfloat16)."""
    return {n: None if t is None else t.float() for n, t in inputs.items()}


def kernel_inputs(kind, x, gt, s, do, dVn, dHnext, T, H, HV):
    """The kernel's arguments in FLA's layout (q and k: key heads only; the kernel maps each value head
    to its key head)."""
    fla = lambda t: to_fla(t, T)
    return dict(
        q=fla(x.q)[:, :, ::HV // H].contiguous(), k=fla(x.k)[:, :, ::HV // H].contiguous(), v=fla(x.v),
        v_new=fla(s.Vn), g=fla(gt.G)[..., 0] / math.log(2) if kind == "gdn" else None, beta=fla(x.b)[..., 0],
        A=fla(s.A), h=s.Hs.permute(1, 0, 2, 3, 4).contiguous(), dh=dHnext.permute(1, 0, 2, 3, 4).contiguous(),
        do=fla(do), dv2=fla(dVn))
