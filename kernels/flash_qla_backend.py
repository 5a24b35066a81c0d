"""The flash_qla backend: Gated DeltaNet through FlashQLA's fused kernels, inside rewy's autograd boundary.

FlashQLA (the ``flash-qla`` package: TileLang kernels for Hopper and SM100)
runs GDN's chunked forward and backward as a few fused kernels and splits one
long sequence across the GPU by itself. Where it is installed, can serve a
call and is faster there (flash_qla_route.py), ``backend="auto"`` sends GDN
calls here. Reaching it through kernels/core.py, rather than through its own
entry (which carries ``torch.compiler.disable``), keeps a compiled patched
model free of graph breaks, and puts its calls in rewy's dispatch report.

forward   q/k l2norm (the Triton backend's) -> FlashQLA's forward: gate chunk cumsum, the WY
          inverse A, the output and the final state
saves     the gate cumsum and A, as FlashQLA's own autograd function does (its states are
          recomputed in its backward, so there is no policy to choose: both run the same)
backward  FlashQLA's backward -> l2norm backward

FlashQLA's forward can cache its split of a long sequence for the backward in a Python object;
the custom op boundary carries tensors only, so the backward rebuilds that split (a few small
kernels, only where the split is on).
"""

from __future__ import annotations

import torch

from .constants import CHUNK
from .core_args import CoreArgs
from .triton_backend.qk_l2norm import normalize, normalize_backward

__all__ = ["forward", "backward", "saved_like", "normalised_qk"]


def _saved_names(a: CoreArgs) -> tuple[str, ...]:
    return ("g_cumsum", "A") + (("q", "k", "q_rstd", "k_rstd") if a.qk_l2norm else ())


def _inputs(a: CoreArgs):
    q, q_rstd = normalize(a.q.contiguous(), a.qk_l2norm)
    k, k_rstd = normalize(a.k.contiguous(), a.qk_l2norm)
    h0 = None if a.h0 is None else a.h0.float().contiguous()
    return q, k, q_rstd, k_rstd, a.v.contiguous(), a.beta.contiguous(), h0


def forward(a: CoreArgs):
    """(o in v's dtype, the final state float32 in the caller's layout, the saved tensors)."""
    import flash_qla

    q, k, q_rstd, k_rstd, v, beta, h0 = _inputs(a)
    # float32 gates: FlashQLA's chunk cumsum keeps the gate's dtype, and a bf16 cumsum over a
    # chunk loses the decay's precision.
    g_cumsum, A, o, _, ht, _ = flash_qla.chunk_gated_delta_rule_fwd(
        q=q, k=k, v=v, g=a.g.float().contiguous(), beta=beta, scale=a.scale, initial_state=h0,
        cu_seqlens=a.cu_seqlens, output_final_state=True, output_h=False, auto_cp=True,
        state_v_first=a.state_v_first, enable_fwd_cp_cache=False, is_train=True)
    saved = {"g_cumsum": g_cumsum, "A": A, "q": q, "k": k, "q_rstd": q_rstd, "k_rstd": k_rstd}
    return o.to(a.v.dtype), ht.float(), [saved[n] for n in _saved_names(a)]


def saved_like(a: CoreArgs, dynamic_size) -> list[torch.Tensor]:
    """Empty tensors shaped as ``forward``'s saved ones (all sizes follow from the inputs')."""
    B, T, H, _ = a.q.shape
    HV = a.v.shape[2]
    like = {"g_cumsum": ((B, T, HV), torch.float32), "A": ((B, T, HV, CHUNK), a.k.dtype),
            "q": (a.q.shape, a.q.dtype), "k": (a.k.shape, a.k.dtype),
            "q_rstd": ((B, T, H), torch.float32), "k_rstd": ((B, T, H), torch.float32)}
    return [a.q.new_empty(like[n][0], dtype=like[n][1]) for n in _saved_names(a)]


def normalised_qk(a: CoreArgs) -> tuple[int, int] | None:
    """Where the normalised q and k are in the saved list (with ``qk_l2norm``), else None."""
    if not a.qk_l2norm:
        return None
    names = _saved_names(a)
    return names.index("q"), names.index("k")


def backward(a: CoreArgs, saved: list, do: torch.Tensor, dht: torch.Tensor | None):
    """(dq, dk, dv, dg, dbeta, None, dh0) in the inputs' shapes and dtypes."""
    import flash_qla

    t = dict(zip(_saved_names(a), saved))
    if a.qk_l2norm:
        q, k, q_rstd, k_rstd = t["q"], t["k"], t["q_rstd"], t["k_rstd"]
    else:
        q, k, q_rstd, k_rstd = a.q.contiguous(), a.k.contiguous(), None, None
    h0 = None if a.h0 is None else a.h0.float().contiguous()
    dq, dk, dv, db, dg, dh0 = flash_qla.chunk_gated_delta_rule_bwd(
        q=q, k=k, v=a.v.contiguous(), g=t["g_cumsum"], beta=a.beta.contiguous(), A=t["A"],
        do=do.contiguous(), dht=None if dht is None else dht.float().contiguous(), scale=a.scale,
        initial_state=h0, cu_seqlens=a.cu_seqlens, state_v_first=a.state_v_first, auto_cp=True)
    # FlashQLA's gradients are float32: the l2norm backward takes them so, as FlashQLA's own does.
    dq, dk = normalize_backward(q, q_rstd, dq, cast=False), normalize_backward(k, k_rstd, dk, cast=False)
    if a.h0 is not None and dh0 is None:        # FlashQLA leaves dh0 out where it is zero
        dh0 = torch.zeros_like(a.h0)
    return (dq.to(a.q.dtype), dk.to(a.k.dtype), dv.to(a.v.dtype), dg.to(a.g.dtype), db.to(a.beta.dtype), None,
            None if a.h0 is None else dh0.to(a.h0.dtype))
