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
saves     the gate cumsum, A and the split (below), as FlashQLA's own autograd function does (its
          states are recomputed in its backward, so there is no policy to choose: both run the same)
backward  FlashQLA's backward -> l2norm backward

Where FlashQLA splits one long row (B = 1, dense or packed) into segments that run at once, its
forward works out each segment's entering state, its state map and the warm-up chunks of the
reverse pass; its own autograd function keeps them in a Python object for the backward. The custom
op boundary carries tensors only, so they travel here as four saved tensors whose leading size,
the number of segments, is known only at run time (0 where FlashQLA does not split). Without
them the backward would rebuild the split: two more map walks and a warm-up pass per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import CHUNK
from .core_args import CoreArgs
from .errors import UnsupportedConfigError
from .triton_backend.qk_l2norm import normalize, normalize_backward

__all__ = ["forward", "backward", "saved_like", "normalised_qk"]


SPLIT_NAMES = ("split_h0", "split_maps", "split_warmup", "split_fallback")


# Whether ``backward`` reads the gate's values (else the core keeps a stand-in in their place):
# its backward works from the gate's chunk cumsum that FlashQLA's forward returned.
BACKWARD_READS_GATE = False


def _saved_names(a: CoreArgs) -> tuple[str, ...]:
    return ("g_cumsum", "A") + SPLIT_NAMES + (("q", "k", "q_rstd", "k_rstd") if a.qk_l2norm else ())


@dataclass
class _SplitCache:
    """What FlashQLA's backward reads of its forward's split cache (attributes only)."""
    h0: torch.Tensor
    mt: torch.Tensor
    num_warmup_bwd: torch.Tensor
    fallback_bwd: torch.Tensor
    m_first: None = None           # only for splits across GPUs, which rewy does not route here


def _split_like(a: CoreArgs, segments) -> dict:
    """Shapes and dtypes of the carried split for ``segments`` segments: FlashQLA's entering states
    (float32, the caller's state layout), its K x K segment maps (in k's dtype), and per (segment,
    value head) the reverse pass's warm-up chunk count (in the dtype of the row bounds FlashQLA
    works with: int32 when it builds them for a dense row) and fallback flag."""
    HV, K, V = a.v.shape[2], a.k.shape[-1], a.v.shape[-1]
    bounds = torch.int32 if a.cu_seqlens is None else a.cu_seqlens.dtype
    state = (V, K) if a.state_v_first else (K, V)
    return {"split_h0": ((segments, HV, *state), torch.float32), "split_maps": ((segments, HV, K, K), a.k.dtype),
            "split_warmup": ((segments, HV), bounds), "split_fallback": ((segments, HV), torch.bool)}


def _split_tensors(a: CoreArgs, cache) -> list[torch.Tensor]:
    """The forward's split cache as the four saved tensors (empty, zero segments, without a split)."""
    if cache is None:
        like = _split_like(a, 0)
        return [a.q.new_empty(like[n][0], dtype=like[n][1]) for n in SPLIT_NAMES]
    got = tuple(getattr(cache, n, None) for n in ("h0", "mt", "num_warmup_bwd", "fallback_bwd"))
    like = _split_like(a, 0 if got[0] is None else got[0].shape[0])
    for n, t in zip(SPLIT_NAMES, got):
        if t is None or tuple(t.shape) != like[n][0]:
            raise UnsupportedConfigError(
                f"FlashQLA's forward split cache has {n} of shape {None if t is None else tuple(t.shape)}, rewy "
                f"expects {like[n][0]}: this flash-qla version keeps its split differently from 0.1.3. Install "
                f"flash-qla 0.1.3, or pass backend='triton' to run rewy's own kernels.")
    # Same values in the dtype the fake implementation declares (a no-op for flash-qla 0.1.3).
    return [t.to(like[n][1]) for n, t in zip(SPLIT_NAMES, got)]


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
    g_cumsum, A, o, _, ht, cp_cache = flash_qla.chunk_gated_delta_rule_fwd(
        q=q, k=k, v=v, g=a.g.float().contiguous(), beta=beta, scale=a.scale, initial_state=h0,
        cu_seqlens=a.cu_seqlens, output_final_state=True, output_h=False, auto_cp=True,
        state_v_first=a.state_v_first, enable_fwd_cp_cache=True, is_train=True)
    saved = {"g_cumsum": g_cumsum, "A": A, "q": q, "k": k, "q_rstd": q_rstd, "k_rstd": k_rstd,
             **dict(zip(SPLIT_NAMES, _split_tensors(a, cp_cache)))}
    return o.to(a.v.dtype), ht.float(), [saved[n] for n in _saved_names(a)]


def saved_like(a: CoreArgs, dynamic_size) -> list[torch.Tensor]:
    """Empty tensors shaped as ``forward``'s saved ones: sizes follow from the inputs', except the
    number of split segments, which FlashQLA decides at run time (``dynamic_size()``)."""
    B, T, H, _ = a.q.shape
    HV = a.v.shape[2]
    like = {"g_cumsum": ((B, T, HV), torch.float32), "A": ((B, T, HV, CHUNK), a.k.dtype),
            "q": (a.q.shape, a.q.dtype), "k": (a.k.shape, a.k.dtype),
            "q_rstd": ((B, T, H), torch.float32), "k_rstd": ((B, T, H), torch.float32),
            **_split_like(a, dynamic_size())}
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
    split = [t[n] for n in SPLIT_NAMES]
    cache = _SplitCache(*split) if split[0].shape[0] else None
    dq, dk, dv, db, dg, dh0 = flash_qla.chunk_gated_delta_rule_bwd(
        q=q, k=k, v=a.v.contiguous(), g=t["g_cumsum"], beta=a.beta.contiguous(), A=t["A"],
        do=do.contiguous(), dht=None if dht is None else dht.float().contiguous(), scale=a.scale,
        initial_state=h0, cu_seqlens=a.cu_seqlens, state_v_first=a.state_v_first, auto_cp=True, cp_cache=cache)
    # FlashQLA's gradients are float32: the l2norm backward takes them so, as FlashQLA's own does.
    dq, dk = normalize_backward(q, q_rstd, dq, cast=False), normalize_backward(k, k_rstd, dk, cast=False)
    if a.h0 is not None and dh0 is None:        # FlashQLA leaves dh0 out where it is zero
        dh0 = torch.zeros_like(a.h0)
    return (dq.to(a.q.dtype), dk.to(a.k.dtype), dv.to(a.v.dtype), dg.to(a.g.dtype), db.to(a.beta.dtype), None,
            None if a.h0 is None else dh0.to(a.h0.dtype))
