"""The sequence-parallel state recurrences (kernels/triton_state_scan.py) under
TRITON_INTERPRET=1, against the torch backend's own states and state gradients.

Inputs are the torch backend's intermediates moved to FLA's layout (as in
test_triton_gdn_bwd.py). FLA's local dv (the recurrence's input in backward)
is recovered from the torch backend as dVn - k_g dH, chunk by chunk.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rewy_hf.kernels.chunk_backward import reverse_state_pass
from rewy_hf.kernels.chunk_forward import ChunkInputs
from rewy_hf.kernels.layout import ChunkLayout
from rewy_hf.kernels.torch_function import CHUNK_SIZE, _forward_pass
from rewy_hf.kernels.triton_state_scan import segments_for, state_backward, state_forward
from rewy_hf.rel_error import rel_err

C = CHUNK_SIZE


def _to_fla(x: torch.Tensor, T: int) -> torch.Tensor:
    """[NT, N, H, C, D] -> [N, T, H, D] (dropping padded rows past T), as the op's layout maps back."""
    return ChunkLayout(x.shape[1], T, C, None, x.device).from_chunks(x).contiguous()


def _case(kind, N, H, HV, K, V, T, seed, with_h0):
    gen = torch.Generator().manual_seed(seed)
    NT = math.ceil(T / C)
    shape = (NT, N, HV, C)
    valid = (torch.arange(NT * C) < T).view(NT, 1, 1, C, 1).float()
    qk = lambda: F.normalize(torch.randn(NT, N, H, C, K, generator=gen), dim=-1).repeat_interleave(HV // H, dim=2)
    q, k = qk() * valid, qk() * valid
    v = torch.randn(*shape, V, generator=gen) * valid
    gate_dim = {"gdn": 1, "kda": K}.get(kind)
    g = F.logsigmoid(torch.randn(*shape, gate_dim, generator=gen)) * valid if gate_dim else torch.zeros(*shape, 1)
    b = torch.rand(*shape, 1, generator=gen) * valid
    x = ChunkInputs(q, k, v, g, b, None, scale=K ** -0.5)
    h0 = torch.randn(N, HV, K, V, generator=gen) * 0.3 if with_h0 else None
    gt, s, ht = _forward_pass(x, h0 if with_h0 else torch.zeros(N, HV, K, V))
    do = torch.randn(*shape, V, generator=gen) * valid
    dht = torch.randn(N, HV, K, V, generator=gen) * 0.3 if with_h0 else None
    dVn, dHnext, dh0 = reverse_state_pass(x, gt, s, do, dht if with_h0 else torch.zeros(N, HV, K, V))
    dv_local = dVn - (x.k * gt.eKc) @ dHnext
    fla = lambda t: _to_fla(t, T)
    Kd = K
    inputs = dict(q=fla(x.q)[:, :, ::HV // H].contiguous(), k=fla(x.k)[:, :, ::HV // H].contiguous(),
                  w=fla(s.WU[..., :Kd]), u=fla(s.WU[..., Kd:]), do=fla(do), dv=fla(dv_local),
                  g=fla(gt.G)[..., 0] / math.log(2) if kind == "gdn" else None, gk=None,
                  h0=h0, dht=dht, scale=x.scale)
    if kind == "kda":
        # FLA's KDA passes per-key gates with q and k already gated, one per value head.
        inputs.update(q=fla(x.q * gt.eG), k=fla(x.k * gt.eKc), gk=fla(gt.G) / math.log(2))
    ref = dict(h=s.Hs.permute(1, 0, 2, 3, 4), v_new=fla(s.Vn), ht=ht,
               dh=dHnext.permute(1, 0, 2, 3, 4), dv2=fla(dVn), dh0=dh0)
    return inputs, ref


@pytest.mark.parametrize("kind,T,K,V,NS,with_h0", [
    ("gdn", 600, 32, 16, 3, True),       # ragged last chunk, 10 chunks in segments of 4, 4, 2
    ("gdn", 512, 64, 32, 8, False),      # one chunk per segment
    ("gdn", 300, 96, 16, 1, True),       # a single segment is the sequential recurrence
    ("delta_rule", 450, 32, 48, 4, True),
    ("kda", 600, 32, 16, 3, True),
    ("kda", 300, 64, 32, 2, False),
])
def test_forward_and_backward_match_torch_states(kind, T, K, V, NS, with_h0):
    _check_against_torch(kind, T, K, V, NS, with_h0)


@pytest.mark.parametrize("BV", [32, 64])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_each_column_block_width(kind, BV):
    """K = V = 128, both state row halves, with each column width the autotuner may pick
    (the interpreter otherwise runs only the first config)."""
    import triton

    from rewy_hf.cpu_triton import only_config
    from rewy_hf.kernels import triton_state_scan as S

    with only_config(S._segment_kernel, triton.Config({"BV": BV}, num_warps=4, num_stages=2)):
        _check_against_torch(kind, 256, 128, 128, 3, True)


def _check_against_torch(kind, T, K, V, NS, with_h0):
    N, H, HV = 2, 1, 2
    x, ref = _case(kind, N, H, HV, K, V, T, seed=T + K, with_h0=with_h0)
    h, v_new, ht = state_forward(x["k"], x["w"], x["u"], x["g"], x["h0"], NS=NS, gk=x["gk"])
    dh, dh0, dv2 = state_backward(x["q"], x["k"], x["w"], x["do"], x["dv"], x["g"], x["dht"], x["scale"], NS=NS,
                                  gk=x["gk"])
    errors = {"h": rel_err(h, ref["h"]), "v_new": rel_err(v_new, ref["v_new"]), "ht": rel_err(ht, ref["ht"]),
              "dh": rel_err(dh, ref["dh"]), "dv2": rel_err(dv2, ref["dv2"])}
    if with_h0:
        errors["dh0"] = rel_err(dh0, ref["dh0"])
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("B,HV,T,V,expected", [
    (8, 16, 2048, 128, 1),        # 256 sequential programs already fill 132 SMs
    (1, 16, 16384, 128, 9),       # 32 programs: 9 segments make 288, about 2 x 132
    (1, 32, 32768, 128, 5),       # 64 programs -> 320
    (2, 32, 4096, 128, 1),        # 128 programs: just under 132 but over half, stay sequential
    (1, 2, 512, 128, 1),          # 8 chunks: too short to split
])
def test_segment_count(B, HV, T, V, expected):
    assert segments_for(B, HV, T, V, sm_count=132) == expected


def test_sequence_parallel_switch(monkeypatch):
    from rewy_hf.kernels.triton_state_scan import SEQUENCE_PARALLEL_ENV, sequence_segments

    k, v = torch.empty(1, 16384, 16, 128), torch.empty(1, 16384, 16, 128)
    monkeypatch.delenv(SEQUENCE_PARALLEL_ENV, raising=False)
    assert sequence_segments(k, v, None) == 1                    # off by default
    monkeypatch.setenv(SEQUENCE_PARALLEL_ENV, "auto")
    assert sequence_segments(k, v, None) == 9
    assert sequence_segments(k, v, torch.tensor([0, 16384])) == 1  # packed sequences stay sequential
    assert sequence_segments(k, v, None, state_v_first=True) == 1
    monkeypatch.setenv(SEQUENCE_PARALLEL_ENV, "6")
    assert sequence_segments(k, v, None) == 6
    wide = torch.empty(1, 16384, 16, 256)                       # key head dim above the split's 128
    with pytest.raises(ValueError, match="key head dims up to 128, this call has 256; use auto"):
        sequence_segments(wide, v, None)
    monkeypatch.setenv(SEQUENCE_PARALLEL_ENV, "auto")
    assert sequence_segments(wide, v, None) == 1                 # auto keeps FLA's sequential kernels there
    monkeypatch.setenv(SEQUENCE_PARALLEL_ENV, "sometimes")
    with pytest.raises(ValueError, match="REWY_HF_SEQUENCE_PARALLEL='sometimes' is not understood; use off, auto"):
        sequence_segments(k, v, None)
