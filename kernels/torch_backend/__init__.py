"""Entry point of the torch backend in FLA's token layout.

Takes already-activated inputs (q, k l2-normalised if asked, gates in log
space, betas in their final range) in ``[B, T, H, D]`` and returns
``(o, final_state)``. Handles the compute dtype, GVA head expansion, ragged T,
``cu_seqlens`` packing and the state layout, then calls the autograd Function.
"""

from __future__ import annotations

import torch

from .layout import ChunkLayout
from ..constants import CHUNK
from ..reference import expand_gva
from .function import ReWYChunkFunction


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (the ground-truth tests); everything else runs in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def delta_rule_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor,
    w: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    state_v_first: bool,
    policy: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """General delta rule. Shapes: q, k [B, T, H, K]; v [B, T, HV, V];
    g [B, T, HV, 1 or K] or None; b [B, T, HV, 1 or K]; w [B, T, HV, 1 or V] or
    None (then w is b, the scalar beta)."""
    dt = compute_dtype(q)
    B, T, _, _ = q.shape
    HV = v.shape[2]
    layout = ChunkLayout(B, T, CHUNK, cu_seqlens, q.device)
    q, k = expand_gva(q, HV), expand_gva(k, HV)
    chunked = [None if t is None else layout.to_chunks(t.to(dt)) for t in (q, k, v, g, b, w)]
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(dt)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
        h0 = h0.contiguous()
    # Autocast (mixed-precision training) would run the chunk math's products in bf16 and
    # break the float32 contract (on CUDA the triangular solve refuses bf16 outright).
    with torch.autocast(q.device.type, enabled=False):
        o, ht = ReWYChunkFunction.apply(*chunked, h0, scale, policy)
    o = layout.from_chunks(o).to(v.dtype)
    if not output_final_state:
        return o, None
    return o, (ht.transpose(-1, -2) if state_v_first else ht)
