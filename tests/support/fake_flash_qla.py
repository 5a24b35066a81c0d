"""A stand-in for the ``flash_qla`` package on CPU: its two entry points, computed by rewy's
float64 reference recurrence.

It keeps FlashQLA's contract as far as rewy's flash_qla backend relies on it: the forward takes
raw log-gates and returns their chunk-local cumsum, an A of shape [B, T, HV, 64] in k's dtype,
o in v's dtype and a float32 final state; the backward takes that cumsum and A and returns
(dq, dk, dv, dbeta, dg, dh0) with dg for the raw gates and dq, dk folded to the key heads.
The A it returns carries no information: the backward rebuilds everything from the inputs, so
a backend that saved the wrong tensors, or mixed up the order of the gradients, fails the
comparison with autograd through the reference.

Asked for its split cache (``enable_fwd_cp_cache``), the forward of a single row of at least two
chunks returns one as FlashQLA 0.1.3 does (an object with ``h0``, ``mt``, ``num_warmup_bwd``,
``fallback_bwd``, one row per segment, in FlashQLA's dtypes), filled with random values; the
backward checks that the cache it is handed is that one, value for value, and counts it.
"""

from __future__ import annotations

import torch

from rewy_hf.kernels.reference import naive_gated_delta_rule

CHUNK = 64
calls = {"fwd": 0, "bwd": 0}
# "issued": split caches the forward returned; "reused": backward calls handed the last of them
# back intact; "rebuilt": backward calls after a split that were handed no cache.
splits = {"issued": 0, "reused": 0, "rebuilt": 0}
_last_split = []


class SplitCache:
    def __init__(self, **fields):
        self.__dict__.update(m_first=None, **fields)


def _split(k, v, cu_seqlens, state_v_first):
    """A cache for one row of at least two chunks: a segment per two chunks, random contents."""
    B, T, HV, V = v.shape
    if B != 1 or T < 2 * CHUNK:
        return None
    P, K = -(-T // (2 * CHUNK)), k.shape[-1]
    gen = torch.Generator().manual_seed(T)
    bounds = torch.int32 if cu_seqlens is None else cu_seqlens.dtype
    return SplitCache(h0=torch.randn(P, HV, *((V, K) if state_v_first else (K, V)), generator=gen),
                      mt=torch.randn(P, HV, K, K, generator=gen).to(k.dtype),
                      num_warmup_bwd=torch.randint(0, 4, (P, HV), generator=gen).to(bounds),
                      fallback_bwd=torch.rand(P, HV, generator=gen) < 0.5)


def _chunk_starts(T: int, cu_seqlens) -> torch.Tensor:
    """A [T] bool mask of the tokens that open a chunk (chunks restart at every sequence)."""
    bounds = [0, T] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    first = torch.zeros(T, dtype=torch.bool)
    for s, e in zip(bounds, bounds[1:]):
        first[s:e:CHUNK] = True
    return first


def _cumsum(g: torch.Tensor, cu_seqlens) -> torch.Tensor:
    out = torch.empty_like(g)
    starts = _chunk_starts(g.shape[1], cu_seqlens).nonzero().flatten().tolist() + [g.shape[1]]
    for s, e in zip(starts, starts[1:]):
        out[:, s:e] = g[:, s:e].cumsum(1)
    return out


def _uncumsum(g_cumsum: torch.Tensor, cu_seqlens) -> torch.Tensor:
    prev = torch.cat([torch.zeros_like(g_cumsum[:, :1]), g_cumsum[:, :-1]], 1)
    first = _chunk_starts(g_cumsum.shape[1], cu_seqlens).view(1, -1, 1)
    return torch.where(first, g_cumsum, g_cumsum - prev)


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                               output_final_state=True, output_h=False, auto_cp=True, state_v_first=False,
                               enable_fwd_cp_cache=False, cp_context=None, is_train=None):
    calls["fwd"] += 1
    o, ht = naive_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=True, state_v_first=state_v_first, cu_seqlens=cu_seqlens)
    B, T, HV = g.shape
    A = torch.zeros(B, T, HV, CHUNK, dtype=k.dtype)
    cache = _split(k, v, cu_seqlens, state_v_first) if enable_fwd_cp_cache else None
    _last_split[:] = [cache]
    splits["issued"] += cache is not None
    return _cumsum(g.float(), cu_seqlens), A, o.to(v.dtype), None, ht.float(), cache


def _check_split(cp_cache):
    issued = _last_split[0] if _last_split else None
    if cp_cache is None:
        splits["rebuilt"] += issued is not None
        return
    assert issued is not None, "handed a split cache after a forward that made none"
    for name in ("h0", "mt", "num_warmup_bwd", "fallback_bwd"):
        got, want = getattr(cp_cache, name), getattr(issued, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert cp_cache.m_first is None
    splits["reused"] += 1


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                               state_v_first=False, auto_cp=True, cp_cache=None, cp_context=None):
    calls["bwd"] += 1
    _check_split(cp_cache)
    assert A.shape == (*g.shape, CHUNK) and g.dtype == torch.float32
    leaves = [x.detach().double() for x in (q, k, v, _uncumsum(g, cu_seqlens), beta)]
    h0 = None if initial_state is None else initial_state.detach().double()

    def run(q, k, v, g, beta, *h0):
        return naive_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0[0] if h0 else None,
                                      output_final_state=True, state_v_first=state_v_first, cu_seqlens=cu_seqlens)

    # torch.func rather than autograd: a custom op's kernel runs below autograd (under torch.compile
    # too), where tensors record no graph.
    (o, ht), vjp = torch.func.vjp(run, *leaves, *([h0] if h0 is not None else []))
    d = vjp((do.double(), torch.zeros_like(ht) if dht is None else dht.double()))
    dq, dk, dv, dg, db = (x.float() for x in d[:5])
    dh0 = d[5].float() if h0 is not None else None
    return dq, dk, dv, db, dg, dh0
