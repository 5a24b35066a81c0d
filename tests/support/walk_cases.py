"""Inputs for the CPU tests of rewy's reverse walk (test_scalar_gate_reverse_walk.py): random GDN /
DeltaNet stage inputs in FLA's layout, the cases they run, and NaN-filled outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nan_fill import nan_filled  # noqa: F401  (the walk's outputs too)
from rewy_hf.kernels.constants import CHUNK as C, RCP_LN2


def log2_cumsum(g, cu_seqlens):
    """FLA's chunk-local cumulative gate in log2 units, chunked per sequence."""
    out = torch.empty_like(g)
    bounds = [0, g.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    for b, e in zip(bounds[:-1], bounds[1:]):
        for s in range(b, e, C):
            out[:, s:min(s + C, e)] = g[:, s:min(s + C, e)].cumsum(1) * RCP_LN2
    return out


def walk_case(gated, B, T, H, HV, K, V, seed, cu_seqlens=None, states=True):
    gen = torch.Generator().manual_seed(seed)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    x = dict(q=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
             k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
             v=torch.randn(B, T, HV, V, generator=gen), beta=torch.rand(B, T, HV, generator=gen),
             A=torch.randn(B, T, HV, C, generator=gen) * 0.5,
             g=log2_cumsum(F.logsigmoid(torch.randn(B, T, HV, generator=gen)), cu_seqlens) if gated else None,
             scale=K ** -0.5, cu_seqlens=cu_seqlens)
    do = torch.randn(B, T, HV, V, generator=gen)
    h0 = torch.randn(N, HV, K, V, generator=gen) * 0.3 if states else None
    dht = torch.randn(N, HV, K, V, generator=gen) * 0.3 if states else None
    return x, do, h0, dht


CASES = {
    "gdn_two_halves": (True, 2, 150, 1, 2, 128, 64, None, True),
    "gdn_one_half_masked": (True, 1, 130, 2, 2, 32, 16, None, False),
    "delta_rule_k64": (False, 2, 128, 2, 2, 64, 32, None, True),
    "gdn_k96_packed_with_empty": (True, 1, 230, 1, 2, 96, 32, [0, 70, 70, 200, 230], True),
}


def named_case(name: str, seed: int):
    """CASES[name]'s inputs: (x, dO, h0, dht, (B, T, HV, V), cu_seqlens); h0 and dht None where the
    case has no states."""
    gated, B, T, H, HV, K, V, cu, states = CASES[name]
    cu = None if cu is None else torch.tensor(cu)
    return (*walk_case(gated, B, T, H, HV, K, V, seed=seed, cu_seqlens=cu, states=states), (B, T, HV, V), cu)
