"""rewy's fused w/u recompute + local dv kernel for GDN / DeltaNet, under TRITON_INTERPRET=1.

It is fed the torch backend's inputs and A, moved to FLA's layout, and must
reproduce the torch backend's W = A X, U = A Y and the local value gradient
Aqk^T dO to float32 accuracy (float16 once, for the 16-bit operand path).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nan_fill import nan_filled
from rewy_hf.kernels.constants import CHUNK as C
from rewy_hf.kernels.torch_backend.chunk_forward import ChunkInputs
from rewy_hf.kernels.torch_backend.function import forward_pass
from rewy_hf.kernels.torch_backend.layout import ChunkLayout
from rewy_hf.kernels.triton_backend.scalar_gate.prestage import recompute_wu_and_dv_local
from rewy_hf.rel_error import rel_err


def _to_fla(x: torch.Tensor, T: int) -> torch.Tensor:
    """[NT, N, H, C, D] -> [N, T, H, D] (dropping padded rows past T), as the op's layout maps back."""
    return ChunkLayout(x.shape[1], T, C, None, x.device).from_chunks(x).contiguous()


def _case(kind: str, N: int, H: int, HV: int, T: int, K: int, V: int, seed: int):
    """The kernel's inputs in FLA's layout (float32) and the torch backend's w, u, dV_loc computed in
    float64 from the same values (the ground truth)."""
    NT = math.ceil(T / C)
    gen = torch.Generator().manual_seed(seed)
    shape = (NT, N, HV, C)
    valid = (torch.arange(NT * C) < T).view(NT, 1, 1, C, 1).float()
    qk = lambda: F.normalize(torch.randn(NT, N, H, C, K, generator=gen), dim=-1).repeat_interleave(HV // H, dim=2)
    q, k = qk() * valid, qk() * valid
    v = torch.randn(*shape, V, generator=gen) * valid
    g = F.logsigmoid(torch.randn(*shape, 1, generator=gen)) * valid if kind == "gdn" else torch.zeros(*shape, 1)
    b = torch.rand(*shape, 1, generator=gen) * valid
    do = torch.randn(*shape, V, generator=gen) * valid
    q, k, v, g, b, do = (t.double() for t in (q, k, v, g, b, do))
    x = ChunkInputs(q, k, v, g, b, None, scale=K ** -0.5)
    gt, s, _ = forward_pass(x, torch.zeros(N, HV, K, V, dtype=torch.float64))
    fla = lambda t: _to_fla(t, T).float()
    inputs = dict(q=fla(q)[:, :, ::HV // H].contiguous(), k=fla(k)[:, :, ::HV // H].contiguous(), v=fla(v),
                  beta=fla(b)[..., 0], A=fla(s.A), do=fla(do),
                  g=fla(gt.G)[..., 0] / math.log(2) if kind == "gdn" else None, scale=x.scale)
    ref = tuple(_to_fla(t, T) for t in (s.WU[..., :K], s.WU[..., K:], s.Aqk.transpose(-1, -2) @ do))
    return inputs, ref


@pytest.mark.parametrize("kind,T,K,V,block", [("gdn", 2 * C, 32, 64, 64), ("gdn", 150, 128, 128, 64),
                                              ("gdn", 100, 96, 32, 128), ("delta_rule", 150, 64, 128, 64),
                                              ("delta_rule", 70, 128, 16, 128)])
def test_matches_torch_stage(kind, T, K, V, block, monkeypatch):
    nan_filled(monkeypatch)
    inputs, ref = _case(kind, 2, 1, 2, T, K, V, seed=T + K + V)
    out = recompute_wu_and_dv_local(**inputs, block=block)
    errors = {name: rel_err(o, r) for name, o, r in zip(("w", "u", "dv"), out, ref)}
    assert max(errors.values()) < 1e-5, errors


def test_float16_inputs_stay_within_half_precision(monkeypatch):
    """float16 inputs (the interpreter's stand-in for BF16): each product takes 16-bit operands and
    accumulates in fp32, and the outputs come back in float16, within half-precision rounding of
    the float32 reference."""
    nan_filled(monkeypatch)
    inputs, ref = _case("gdn", 1, 1, 1, 128, 64, 64, seed=3)
    half = {n: (t.half() if torch.is_tensor(t) and n not in ("g", "beta") else t) for n, t in inputs.items()}
    out = recompute_wu_and_dv_local(**half)
    for o, r in zip(out, ref):
        assert o.dtype == torch.float16
        assert rel_err(o.float(), r) < 5e-3


@pytest.mark.parametrize("kind", ["gdn", "delta_rule"])
def test_packed_sequences(kind, monkeypatch):
    """cu_seqlens: sequences packed in one row, each chunked on its own, get their own results."""
    nan_filled(monkeypatch)
    lengths, K, V = [70, 130, 20], 64, 32
    cases = [_case(kind, 1, 1, 2, T, K, V, seed=20 + i) for i, T in enumerate(lengths)]
    packed = {n: (torch.cat([c[0][n] for c in cases], dim=1) if torch.is_tensor(cases[0][0][n]) else cases[0][0][n])
              for n in cases[0][0]}
    cu = torch.tensor([0] + lengths).cumsum(0)
    out = recompute_wu_and_dv_local(**packed, cu_seqlens=cu)
    for i, o in enumerate(out):
        assert rel_err(o, torch.cat([c[1][i] for c in cases], dim=1)) < 1e-5


def test_bad_arguments_name_the_fix():
    inputs, _ = _case("gdn", 2, 1, 1, 64, 32, 32, seed=0)
    with pytest.raises(ValueError, match="block=32: use 64 or 128"):
        recompute_wu_and_dv_local(**inputs, block=32)
    with pytest.raises(ValueError, match="need B = 1"):
        recompute_wu_and_dv_local(**inputs, cu_seqlens=torch.tensor([0, 32, 64]))



@pytest.mark.parametrize("K,V,narrow", [(16, 16, True), (32, 128, True), (128, 32, True), (64, 64, False),
                                        (128, 128, False), (96, 96, False)])
def test_tiles_below_64_take_only_the_8_warp_configs(K, V, narrow, monkeypatch):
    """At key or value tiles below 64 the prestage runs the kernel whose configs are all 8-warp ones
    (the 4-warp builds faulted there on the H200 under triton 3.6), and the launch reaches it."""
    from rewy_hf.kernels.triton_backend.scalar_gate import prestage

    chosen = []
    real = prestage.launch
    monkeypatch.setattr(prestage, "launch", lambda kernel, *a, **kw: chosen.append(kernel) or real(kernel, *a, **kw))
    inputs, ref = _case("gdn", 1, 1, 1, 80, K, V, seed=K + V)
    out = recompute_wu_and_dv_local(**inputs)
    assert max(rel_err(o, r) for o, r in zip(out, ref)) < 1e-5
    assert chosen == [prestage.rewy_gdn_prestage_kernel_narrow if narrow else prestage.rewy_gdn_prestage_kernel]
    listed = getattr(chosen[0], "listed_configs", chosen[0].configs)       # the whole list under the test cut
    assert {c.num_warps for c in listed} == ({8} if narrow else {4, 8})
