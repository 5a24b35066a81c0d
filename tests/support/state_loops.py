"""FLA's two sequential state recurrences written as torch loops, for CPU tests of the
triton-backend Function: FLA's kernels do not run under TRITON_INTERPRET=1 (their
loop indices are plain ints there). Same arguments and outputs as
``state_launch.fwd_h`` / ``state_launch.bwd_dhu`` (FLA's ``chunk_gated_delta_rule_fwd_h`` /
``..._bwd_dhu``): the scalar gate ``g`` [B, T, HV] (GDN) or the key-wise gate ``gk``
[B, T, HV, K] (KDA, GDN2: k and q come in already gated, as FLA's kernels take them), the
state K x V or V x K (``state_v_first``), packed sequences; rows of a batch (B > 1) run as
packed sequences."""

from __future__ import annotations

import torch

from rewy_hf.kernels.constants import CHUNK
from rewy_hf.kernels.triton_backend import state_launch


def _sequences(T, cu_seqlens):
    """Per sequence: its chunks (start, end) and the index of its first chunk, as FLA counts them;
    an empty packed sequence has no chunk (FLA hands its initial state through)."""
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    out, first = [], 0
    for b, e in zip(bounds[:-1], bounds[1:]):
        chunks = [(s, min(s + CHUNK, e)) for s in range(b, e, CHUNK)]
        out.append((chunks, first))
        first += len(chunks)
    return out, first


_PER_TOKEN = ("q", "k", "w", "u", "g", "gk", "do", "dv")


def _rows_as_sequences(fn):
    """B > 1 rows of length T run as B packed sequences; outputs come back per row."""
    def run(*, cu_seqlens=None, **kw):
        B, T = kw["w"].shape[:2]
        if B == 1:
            return fn(cu_seqlens=cu_seqlens, **kw)
        assert cu_seqlens is None, "packed sequences come in one row"
        joined = {n: kw[n].reshape(1, B * T, *kw[n].shape[2:]) for n in _PER_TOKEN if kw.get(n) is not None}
        outputs = fn(**{**kw, **joined}, cu_seqlens=torch.arange(B + 1) * T)

        def per_row(x):
            if x is None or x.shape[0] != 1:
                return x                                           # per-sequence states: already one per row
            return x.view(B, -1, *x.shape[2:])                     # per-chunk states or per-token values
        return tuple(per_row(x) for x in outputs)
    return run


def _gates(g, gk, s, e, HV, K):
    """(the chunk's decay of the state, [HV, K, 1]; the per-token factor 2^(g_C - g) on k, [t, HV, 1]).
    The key-wise gate has no per-token factor here: FLA's kernels take k already gated."""
    if gk is not None:
        return torch.exp2(gk[0, e - 1].float())[..., None], 1.0
    if g is not None:
        gl = g[0, e - 1].float()
        return torch.exp2(gl)[:, None, None], torch.exp2(gl - g[0, s:e].float())[..., None]
    return torch.ones(HV, 1, 1), 1.0


def _k_first(x, state_v_first):
    return None if x is None else (x.transpose(-1, -2) if state_v_first else x).float()


@_rows_as_sequences
def loop_fwd_h(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, state_v_first=False,
               cu_seqlens=None, **_):
    """h[c] = state entering chunk c; v_new = u - w h; S' = decay S + (k 2^(g_C - g))^T v_new."""
    _, T, HV, K = w.shape
    V = u.shape[-1]
    k, w, u = (x.float() for x in (k.repeat_interleave(HV // k.shape[2], dim=2), w, u))
    h0 = _k_first(initial_state, state_v_first)
    sequences, NT = _sequences(T, cu_seqlens)
    h, vn, finals = torch.zeros(1, NT, HV, K, V), torch.zeros_like(u), []
    for n, (chunks, first) in enumerate(sequences):
        S = torch.zeros(HV, K, V) if h0 is None else h0[n].clone()
        for i, (s, e) in enumerate(chunks, start=first):
            h[0, i] = S
            vn[0, s:e] = u[0, s:e] - torch.einsum("thk,hkv->thv", w[0, s:e], S)
            decay, token = _gates(g, gk, s, e, HV, K)
            S = S * decay + torch.einsum("thk,thv->hkv", k[0, s:e], vn[0, s:e] * token)
        finals.append(S)
    ht = torch.stack(finals) if output_final_state else None
    if state_v_first:                   # contiguous in that layout, as FLA's kernels write (and read) it
        h, ht = h.transpose(-1, -2).contiguous(), None if ht is None else ht.transpose(-1, -2).contiguous()
    return h, vn, ht


@_rows_as_sequences
def loop_bwd_dhu(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False,
                 cu_seqlens=None, **_):
    """dh[c] = gradient of the state leaving chunk c; dv2 = dv + (k 2^(g_C - g)) dh;
    dh before chunk c = decay dh + scale (q 2^g)^T do - w^T dv2."""
    _, T, HV, K = w.shape
    V = do.shape[-1]
    q, k = (x.repeat_interleave(HV // x.shape[2], dim=2).float() for x in (q, k))
    w, do, dv = w.float(), do.float(), dv.float()
    dht = _k_first(dht, state_v_first)
    sequences, NT = _sequences(T, cu_seqlens)
    dh, dv2, firsts = torch.zeros(1, NT, HV, K, V), torch.zeros_like(dv), []
    for n, (chunks, first) in enumerate(sequences):
        D = torch.zeros(HV, K, V) if dht is None else dht[n].clone()
        for i, (s, e) in reversed(list(enumerate(chunks, start=first))):
            dh[0, i] = D
            decay, token = _gates(g, gk, s, e, HV, K)
            qg = q[0, s:e] * (torch.exp2(g[0, s:e].float())[..., None] if g is not None else 1.0)
            dv2[0, s:e] = dv[0, s:e] + torch.einsum("thk,hkv->thv", k[0, s:e], D) * token
            D = (D * decay + scale * torch.einsum("thk,thv->hkv", qg, do[0, s:e])
                 - torch.einsum("thk,thv->hkv", w[0, s:e], dv2[0, s:e]))
        firsts.append(D)
    dh0 = torch.stack(firsts) if h0 is not None else None
    if state_v_first:
        dh, dh0 = dh.transpose(-1, -2).contiguous(), None if dh0 is None else dh0.transpose(-1, -2).contiguous()
    return dh, dh0, dv2


def replace_recurrences(monkeypatch, fwd_h=loop_fwd_h, bwd_dhu=loop_bwd_dhu):
    """FLA's two recurrences replaced where the triton backend calls them (``state_launch.fwd_h`` /
    ``bwd_dhu``, looked up as module attributes by the Function, both families and the checkpoint
    rebuild), so the replacements are what run."""
    monkeypatch.setattr(state_launch, "fwd_h", fwd_h)
    monkeypatch.setattr(state_launch, "bwd_dhu", bwd_dhu)
