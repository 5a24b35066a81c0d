"""The eager short convolution on the GPU in bfloat16, as a patched layer calls it: values and input /
weight / bias gradients against the documents run one by one in float64, within 1.1x the error of
FLA's Triton convolution on the same inputs, and on FLA's Gluon kernels wherever this machine has them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rewy_hf.kernels.short_conv import fla_gluon_conv, triton_short_conv
from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu

W = 4
# documents shorter than the width, on and off the kernels' 64-token chunk edges, and one long one
DOCS = (700, 64, 1000, 1, 2, 3, 61, 1265, 2000, 4096)


def reference(x, w, b, docs):
    parts = x.split(list(docs), -1) if docs else [x]
    return torch.cat([F.silu(F.conv1d(p, w[:, None], b, padding=W - 1, groups=p.shape[1])[..., :p.shape[-1]])
                      for p in parts], -1)


def fla_triton(x, w, b, cu):
    from fla.modules.convolution import causal_conv1d

    out, _ = causal_conv1d(x.transpose(1, 2), w, b, activation="silu", backend="triton", cu_seqlens=cu)
    return out.transpose(1, 2)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_bfloat16_within_fla_triton_error_of_float64(packed):
    torch.manual_seed(0)
    B, T, C = (1, sum(DOCS), 1536) if packed else (2, 3000, 1536)
    docs = DOCS if packed else None
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32, device="cuda") if packed else None
    x64 = torch.randn(B, T, C, dtype=torch.float64, device="cuda").transpose(1, 2)
    w64 = torch.randn(C, W, dtype=torch.float64, device="cuda") * 0.5
    b64 = torch.randn(C, dtype=torch.float64, device="cuda") * 0.1
    dy64 = torch.randn(B, T, C, dtype=torch.float64, device="cuda").transpose(1, 2)
    kernels = []

    def ours(x, w, b):
        out, which = triton_short_conv(x, w, b, "silu", cu)
        kernels.append(which)
        return out

    def run(dtype, conv):
        leaves = [t.to(dtype).detach().requires_grad_() for t in (x64, w64, b64)]
        out = conv(*leaves)
        return [out.double(), *(g.double() for g in torch.autograd.grad(out, leaves, dy64.to(dtype)))]

    ref = run(torch.float64, lambda x, w, b: reference(x, w, b, docs))
    got = run(torch.bfloat16, ours)
    fla = run(torch.bfloat16, lambda x, w, b: fla_triton(x, w, b, cu))
    assert kernels == ["fla-gluon" if fla_gluon_conv() is not None else "fla-triton"]
    for name, a, f, r in zip(("y", "dx", "dw", "db"), got, fla, ref):
        assert a.shape == r.shape
        assert rel_err(a, r) <= 1.1 * rel_err(f, r) + 1e-6, (name, rel_err(a, r), rel_err(f, r))
        assert rel_err(a, r) <= 1e-2, (name, rel_err(a, r))


def test_a_channel_major_input_is_laid_out_for_the_kernels():
    """x as a contiguous [B, C, T] tensor (not a view of [B, T, C]): the same values as its [B, T, C]
    twin, so the layout FLA's kernels need is made, never assumed."""
    torch.manual_seed(1)
    x = torch.randn(2, 256, 500, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, W, device="cuda", dtype=torch.bfloat16)
    twin = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(triton_short_conv(x, w, None, "silu")[0], triton_short_conv(twin, w, None, "silu")[0],
                               rtol=0, atol=0)
