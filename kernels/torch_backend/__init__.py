"""The torch backend: the core in plain torch ops, in FLA's token layout at its edges.

Takes a ``CoreArgs`` record (activated inputs, ``[B, T, H, D]``) and handles
the compute dtype (float32, or float64 for float64 inputs), GVA head
expansion, ragged T, ``cu_seqlens`` packing and the state layout around the
chunked math of function.py. ``forward`` returns (o, final state, saved),
``backward`` the input gradients from them, and ``saved_like`` empty tensors
shaped as ``forward``'s saved ones (for the custom op's fake implementation).
"""

from __future__ import annotations

import torch

from ..constants import CHUNK
from ..core_args import CoreArgs
from ..reference import expand_gva
from .function import chunk_backward, chunk_forward, saved_shapes
from .layout import ChunkLayout, packed_chunks


# Whether ``backward`` reads the gate's values (else the core keeps a stand-in in their place):
# its backward rebuilds the gate terms from the gate itself.
BACKWARD_READS_GATE = True


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (the ground-truth tests); everything else runs in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_channel(x: torch.Tensor | None) -> torch.Tensor | None:
    """A per-head scalar [B, T, HV] as [B, T, HV, 1]; a per-channel gate stays as it is."""
    return x if x is None or x.dim() == 4 else x.unsqueeze(-1)


def _chunked(a: CoreArgs):
    dt = compute_dtype(a.q)
    B, T, _, _ = a.q.shape
    HV = a.v.shape[2]
    layout = ChunkLayout(B, T, CHUNK, a.cu_seqlens, a.q.device)
    q, k = expand_gva(a.q, HV), expand_gva(a.k, HV)
    beta = a.beta if a.beta.dim() == 4 else a.beta.unsqueeze(-1)
    chunked = [None if t is None else layout.to_chunks(t.to(dt)) for t in (q, k, a.v, _per_channel(a.g), beta, a.w)]
    if a.h0 is None:
        h0 = q.new_zeros(layout.num_seqs, HV, q.shape[-1], a.v.shape[-1], dtype=dt)
    else:
        h0 = (a.h0.transpose(-1, -2) if a.state_v_first else a.h0).to(dt).contiguous()
    return layout, chunked, h0


def forward(a: CoreArgs):
    layout, chunked, h0 = _chunked(a)
    # Autocast (mixed-precision training) would run the chunk math's products in bf16 and
    # break the float32 contract (on CUDA the triangular solve refuses bf16 outright).
    with torch.autocast(a.q.device.type, enabled=False):
        o, ht, saved = chunk_forward(*chunked, h0, a.scale, a.policy)
    o = layout.from_chunks(o).to(a.v.dtype)
    saved = [layout.pack_slots(t) for t in saved]
    # A copy: under ``full`` the saved states share ht's storage, and a custom op's outputs may not alias.
    ht = ht.transpose(-1, -2).contiguous() if a.state_v_first else ht.clone()
    return o, ht, saved


def saved_like(a: CoreArgs, dynamic_size) -> list[torch.Tensor]:
    """Every size follows from the input shapes (packed calls: the chunk bound of ``pack_slots``);
    ``dynamic_size`` is not needed."""
    B, T, _, K = a.q.shape
    HV, V = a.v.shape[2], a.v.shape[3]
    if a.cu_seqlens is None:
        shapes = saved_shapes(-(-T // CHUNK), B, HV, K, V, a.policy)
    else:
        shapes = saved_shapes(packed_chunks(T, a.sequences, CHUNK), 1, HV, K, V, a.policy)
    return [a.q.new_empty(s, dtype=compute_dtype(a.q)) for s in shapes]


def normalised_qk(a: CoreArgs) -> None:
    """The torch backend takes q and k normalised already: its backward keeps the inputs."""
    return None


def _fold_gva(dx: torch.Tensor, key_heads: int) -> torch.Tensor:
    B, T, HV, D = dx.shape
    return dx if HV == key_heads else dx.view(B, T, key_heads, HV // key_heads, D).sum(3)


def backward(a: CoreArgs, saved: list, do: torch.Tensor, dht: torch.Tensor | None):
    """(dq, dk, dv, dg, dbeta, dw, dh0) in the inputs' shapes and dtypes; None where an input is None."""
    layout, chunked, h0 = _chunked(a)
    saved = [layout.unpack_slots(t) for t in saved]
    do_c = layout.to_chunks(do.to(h0.dtype))
    if dht is not None:
        dht = (dht.transpose(-1, -2) if a.state_v_first else dht).to(h0.dtype).contiguous()
    with torch.autocast(a.q.device.type, enabled=False):
        grads = chunk_backward(*chunked, h0, saved, a.scale, a.policy, do_c, dht)
    dq, dk, dv, dg, db, dw = (None if t is None else layout.from_chunks(t) for t in grads[:6])
    dh0 = grads[6]
    H = a.q.shape[2]
    dq, dk = _fold_gva(dq, H).to(a.q.dtype), _fold_gva(dk, H).to(a.k.dtype)
    dg = None if a.g is None else dg.reshape(a.g.shape).to(a.g.dtype)
    db = db.reshape(a.beta.shape).to(a.beta.dtype)
    dw = None if a.w is None else dw.to(a.w.dtype)
    if a.h0 is None:
        dh0 = None
    else:
        dh0 = (dh0.transpose(-1, -2) if a.state_v_first else dh0).to(a.h0.dtype)
    return dq, dk, dv.to(a.v.dtype), dg, db, dw, dh0
