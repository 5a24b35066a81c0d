"""Inputs for the state-recurrence kernels built from the torch backend's own forward and backward
(kernels/torch_function.py, kernels/chunk_backward.py), moved to FLA's layout, with the torch
backend's states and state gradients as the reference. FLA's local dv (the reverse recurrence's
input) is recovered from the torch backend as dVn - k_g dH, chunk by chunk; ``A`` is its A_qk
(scale and gates in), in FLA's [N, T, HV, BT] layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rewy_hf.kernels.chunk_backward import reverse_state_pass
from rewy_hf.kernels.chunk_forward import ChunkInputs
from rewy_hf.kernels.torch_function import CHUNK_SIZE, _forward_pass

C = CHUNK_SIZE


def _to_fla(x, T):
    NT, N, H, _, D = x.shape
    return x.permute(1, 0, 3, 2, 4).reshape(N, NT * C, H, D)[:, :T].contiguous()


def state_case(kind, N, H, HV, K, V, T, seed, with_h0, dtype=torch.float32):
    """(inputs in FLA's layout, torch backend's reference); ``dtype`` for both (float64: ground truth)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)     # noqa: E731
    NT = math.ceil(T / C)
    shape = (NT, N, HV, C)
    valid = (torch.arange(NT * C) < T).view(NT, 1, 1, C, 1).to(dtype)
    qk = lambda: F.normalize(randn(NT, N, H, C, K), dim=-1).repeat_interleave(HV // H, dim=2)
    q, k = qk() * valid, qk() * valid
    v = randn(*shape, V) * valid
    gate_dim = {"gdn": 1, "kda": K}.get(kind)
    g = F.logsigmoid(randn(*shape, gate_dim)) * valid if gate_dim else torch.zeros(*shape, 1, dtype=dtype)
    b = torch.rand(*shape, 1, generator=gen, dtype=dtype) * valid
    x = ChunkInputs(q, k, v, g, b, None, scale=K ** -0.5)
    h0 = randn(N, HV, K, V) * 0.3 if with_h0 else None
    gt, s, ht = _forward_pass(x, h0 if with_h0 else torch.zeros(N, HV, K, V, dtype=dtype))
    do = randn(*shape, V) * valid
    dht = randn(N, HV, K, V) * 0.3 if with_h0 else None
    dVn, dHnext, dh0 = reverse_state_pass(x, gt, s, do, dht if with_h0 else torch.zeros(N, HV, K, V, dtype=dtype))
    dv_local = dVn - (x.k * gt.eKc) @ dHnext
    fla = lambda t: _to_fla(t, T)
    Kd = K
    inputs = dict(q=fla(x.q)[:, :, ::HV // H].contiguous(), k=fla(x.k)[:, :, ::HV // H].contiguous(),
                  w=fla(s.WU[..., :Kd]), u=fla(s.WU[..., Kd:]), do=fla(do), dv=fla(dv_local),
                  g=fla(gt.G)[..., 0] / math.log(2) if kind == "gdn" else None, gk=None,
                  h0=h0, dht=dht, scale=x.scale, A=fla(s.Aqk))
    if kind == "kda":
        # FLA's KDA passes per-key gates with q and k already gated, one per value head.
        inputs.update(q=fla(x.q * gt.eG), k=fla(x.k * gt.eKc), gk=fla(gt.G) / math.log(2))
    ref = dict(h=s.Hs.permute(1, 0, 2, 3, 4), v_new=fla(s.Vn), ht=ht,
               dh=dHnext.permute(1, 0, 2, 3, 4), dv2=fla(dVn), dh0=dh0)
    return inputs, ref


