"""FLA's two sequential state recurrences written as torch loops, for CPU tests of the
triton-backend Function: FLA's kernels do not run under TRITON_INTERPRET=1 (their
loop indices are plain ints there). Same arguments and outputs as FLA's
``chunk_gated_delta_rule_fwd_h`` / ``..._bwd_dhu`` (scalar gate, K x V state),
packed sequences included; rows of a batch (B > 1) run as packed sequences."""

from __future__ import annotations

import torch

from rewy_hf.kernels import triton_gdn


def _sequences(T, cu_seqlens):
    """Per sequence: its chunks (start, end) and the index of its first chunk, as FLA counts them;
    an empty packed sequence has no chunk (FLA hands its initial state through)."""
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    out, first = [], 0
    for b, e in zip(bounds[:-1], bounds[1:]):
        chunks = [(s, min(s + 64, e)) for s in range(b, e, 64)]
        out.append((chunks, first))
        first += len(chunks)
    return out, first


_PER_TOKEN = ("q", "k", "w", "u", "g", "do", "dv")


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


@_rows_as_sequences
def loop_fwd_h(k, w, u, g=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """h[c] = state entering chunk c; v_new = u - w h; S' = e^{g_C} S + (k e^{g_C-g})^T v_new."""
    _, T, HV, K = w.shape
    V = u.shape[-1]
    k = k.repeat_interleave(HV // k.shape[2], dim=2)
    sequences, NT = _sequences(T, cu_seqlens)
    h, vn, finals = torch.zeros(1, NT, HV, K, V), torch.zeros_like(u), []
    for n, (chunks, first) in enumerate(sequences):
        S = torch.zeros(HV, K, V) if initial_state is None else initial_state[n].clone().float()
        for i, (s, e) in enumerate(chunks, start=first):
            h[0, i] = S
            vn[0, s:e] = u[0, s:e] - torch.einsum("thk,hkv->thv", w[0, s:e], S)
            gl = g[0, e - 1] if g is not None else torch.zeros(HV)
            decay = torch.exp2(gl - g[0, s:e]) if g is not None else torch.ones(e - s, HV)
            S = S * torch.exp2(gl)[:, None, None] + torch.einsum("thk,thv->hkv", k[0, s:e],
                                                                 vn[0, s:e] * decay[..., None])
        finals.append(S)
    return h, vn, torch.stack(finals) if output_final_state else None


@_rows_as_sequences
def loop_bwd_dhu(q, k, w, do, dv, g=None, h0=None, dht=None, scale=None, cu_seqlens=None, **_):
    """dh[c] = gradient of the state leaving chunk c; dv2 = dv + (k e^{g_C-g}) dh."""
    _, T, HV, K = w.shape
    V = do.shape[-1]
    q, k = (x.repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
    sequences, NT = _sequences(T, cu_seqlens)
    dh, dv2, firsts = torch.zeros(1, NT, HV, K, V), torch.zeros_like(dv), []
    for n, (chunks, first) in enumerate(sequences):
        D = torch.zeros(HV, K, V) if dht is None else dht[n].clone()
        for i, (s, e) in reversed(list(enumerate(chunks, start=first))):
            dh[0, i] = D
            gl = g[0, e - 1] if g is not None else torch.zeros(HV)
            decay = torch.exp2(gl - g[0, s:e]) if g is not None else torch.ones(e - s, HV)
            qg = q[0, s:e] * (torch.exp2(g[0, s:e])[..., None] if g is not None else 1.0)
            dv2[0, s:e] = dv[0, s:e] + torch.einsum("thk,hkv->thv", k[0, s:e], D) * decay[..., None]
            D = (D * torch.exp2(gl)[:, None, None] + scale * torch.einsum("thk,thv->hkv", qg, do[0, s:e])
                 - torch.einsum("thk,thv->hkv", w[0, s:e], dv2[0, s:e]))
        firsts.append(D)
    return dh, torch.stack(firsts), dv2


def replace_recurrences(monkeypatch, fwd_h, bwd_dhu):
    """FLA's two recurrences replaced; rewy's own launch of FLA's kernels (on by default where B x H
    is small, kernels/state_launch.py, and everywhere with REWY_HF_DIRECT_LAUNCH=1) is switched
    off, so the replacements are what run."""
    stages = triton_gdn._fla
    monkeypatch.setenv("REWY_HF_STATE_BLOCK_V", "fla")
    monkeypatch.setenv("REWY_HF_DIRECT_LAUNCH", "0")

    def patched():
        f = stages()
        f["fwd_h"], f["bwd_dhu"] = fwd_h, bwd_dhu
        return f

    monkeypatch.setattr(triton_gdn, "_fla", patched)
