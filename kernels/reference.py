"""Float64 token-by-token ground truth for the four delta-rule ops.

Every op is a special case of one recurrence, run per (sequence, value head)
on a state S in R^{K x V}:

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    o_t = scale * S_t^T q_t

    GDN2      g_t, b_t in R^K, w_t in R^V
    KDA       g_t in R^K, b_t = w_t = beta_t (one scalar per head)
    GDN       g_t and beta_t scalars per head
    DeltaNet  g_t = 0, beta_t scalar per head

The public ``naive_*`` functions take FLA 0.6.0's argument names and order and
its ``[B, T, H, D]`` layout, cast everything to float64 (autograd stays
connected, so tests can backprop through them) and return ``(o, final_state)``
in float64.  They are slow on purpose: clarity over speed.

Preprocessing conventions (checked against FLA 0.6.0 source and in
``tests/test_reference.py``):

* ``scale`` defaults to ``K ** -0.5`` (K = key head dim).
* ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2) + 1e-6)`` on q and k, before
  the scale is applied and before GVA expansion.
* ``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)``, or
  ``2 * sigmoid(beta)`` with ``allow_neg_eigval`` (which FLA rejects unless the
  sigmoid is in the kernel).
* GDN in-kernel gate: ``g = -exp(A_log) * softplus(g + dt_bias)``, A_log and
  dt_bias of shape ``[HV]``.
* KDA / GDN2 in-kernel gate: ``g = -exp(A_log[h]) * softplus(g + dt_bias[h, :])``
  with A_log numel = number of gate heads and dt_bias numel = heads * K.
  If ``lower_bound`` is set, the in-kernel gate becomes
  ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))`` (or
  ``lower_bound * sigmoid(g + dt_bias)`` when A_log is None).
  FLA's kernel picks the bounded form whenever ``lower_bound is not None``,
  whatever ``safe_gate`` says (``safe_gate`` only selects a faster kernel and
  validates ``-5 <= lower_bound < 0``), even though FLA's docstring phrases it
  as "together with safe_gate".  ``lower_bound`` has NO effect when
  ``use_gate_in_kernel=False``: a pre-computed ``g`` is used as given, not
  clamped.  We mirror exactly that.
* GVA (HV value heads, H key heads, HV % H == 0): value head j reads key head
  ``j // (HV // H)`` (``repeat_interleave`` on the head axis).
* ``state_v_first``: states are stored ``[N, HV, V, K]`` (the transpose of the
  default ``[N, HV, K, V]``) for both initial_state and the returned state.
* ``cu_seqlens`` (B must be 1): each segment runs independently from its own
  ``initial_state[n]``; the final state has one entry per segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "l2norm",
    "beta_activation",
    "gdn_gate",
    "kda_gate",
    "expand_gva",
    "naive_delta_rule",
    "naive_gated_delta_rule",
    "naive_kda",
    "naive_gdn2",
]

L2NORM_EPS = 1e-6


# ---------------------------------------------------------------------------
# Public preprocessing helpers.  They compute in the dtype they are given
# (ordinary torch type promotion between the input and its parameters); the
# naive_* functions below hand them float64 tensors.
# ---------------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last dim (FLA's l2norm, eps 1e-6)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """``sigmoid(beta)``; ``2 * sigmoid(beta)`` (range (0, 2)) with allow_neg_eigval."""
    beta = torch.sigmoid(beta)
    return 2 * beta if allow_neg_eigval else beta


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """GDN scalar gate: ``-exp(A_log) * softplus(g + dt_bias)``; g is [..., HV], A_log/dt_bias [HV]."""
    if dt_bias is not None:
        g = g + dt_bias
    return -A_log.exp() * F.softplus(g)


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA/GDN2 per-channel gate on g of shape [..., H, K].

    A_log has H elements, dt_bias H*K elements.  Without lower_bound:
    ``-exp(A_log[h]) * softplus(g + dt_bias[h])``.  With lower_bound:
    ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))``, where a missing
    A_log means a factor of 1.
    """
    H = g.shape[-2]
    if dt_bias is not None:
        g = g + dt_bias.reshape(H, -1)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("kda_gate: A_log is required when lower_bound is None.")
        return -A_log.reshape(H, 1).exp() * F.softplus(g)
    if A_log is not None:
        g = A_log.reshape(H, 1).exp() * g
    return lower_bound * torch.sigmoid(g)


def expand_gva(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Repeat key heads on dim 2 so value head j uses key head j // (HV // H)."""
    H = x.shape[2]
    if num_v_heads % H != 0:
        raise ValueError(f"GVA needs HV % H == 0, got HV={num_v_heads}, H={H}.")
    return x if num_v_heads == H else x.repeat_interleave(num_v_heads // H, dim=2)


# ---------------------------------------------------------------------------
# The recurrence
# ---------------------------------------------------------------------------

def _recurrence(q, k, v, g, b, w, scale, S):
    """One batch of sequences, token by token.

    q, k: [B, T, HV, K]; v: [B, T, HV, V]; g, b: [B, T, HV, K] or [B, T, HV, 1];
    w: [B, T, HV, V] or [B, T, HV, 1]; S: [B, HV, K, V].  Scalars broadcast.
    Returns o [B, T, HV, V] and the final S.
    """
    outs = []
    for t in range(q.shape[1]):
        k_t = k[:, t]
        S = S * g[:, t].exp().unsqueeze(-1)                            # Diag(exp g) S
        erase = torch.einsum("bhk,bhkv->bhv", b[:, t] * k_t, S)         # (b*k)^T S
        S = S + k_t.unsqueeze(-1) * (w[:, t] * v[:, t] - erase).unsqueeze(-2)
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    if not outs:
        return v.new_zeros(v.shape), S
    return torch.stack(outs, dim=1), S


def _segments(T: int, cu_seqlens: torch.Tensor | None):
    if cu_seqlens is None:
        return None
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T or any(e < s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {bounds}.")
    return list(zip(bounds, bounds[1:]))


def _run(q, k, v, g, b, w, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    """Shared driver: float64 inputs already preprocessed and GVA-expanded."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    segs = _segments(T, cu_seqlens)
    if segs is not None and B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got B={B}.")
    N = B if segs is None else len(segs)
    if initial_state is None:
        h0 = q.new_zeros(N, HV, K, V)
    else:
        h0 = initial_state.double()
        h0 = h0.transpose(-1, -2) if state_v_first else h0
        if h0.shape != (N, HV, K, V):
            raise ValueError(f"initial_state must have {N} states of shape [HV, K, V]=[{HV}, {K}, {V}] "
                             f"(state_v_first={state_v_first}), got {tuple(initial_state.shape)}.")
    if segs is None:
        o, S = _recurrence(q, k, v, g, b, w, scale, h0)
    else:
        os_, Ss = [], []
        for n, (s, e) in enumerate(segs):
            o_n, S_n = _recurrence(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], b[:, s:e], w[:, s:e],
                                   scale, h0[n:n + 1])
            os_.append(o_n)
            Ss.append(S_n)
        o, S = torch.cat(os_, dim=1), torch.cat(Ss, dim=0)
    if not output_final_state:
        return o, None
    return o, (S.transpose(-1, -2) if state_v_first else S)


def _prep_qk(q, k, HV, use_qk_l2norm_in_kernel):
    q, k = q.double(), k.double()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return expand_gva(q, HV), expand_gva(k, HV)


def _prep_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA).")
    beta = beta.double()
    return beta_activation(beta, allow_neg_eigval) if use_beta_sigmoid_in_kernel else beta


def _prep_vector_gate(g, use_gate_in_kernel, safe_gate, lower_bound, A_log, dt_bias):
    """KDA/GDN2 gate; lower_bound only matters for the in-kernel gate (FLA semantics)."""
    g = g.double()
    if not use_gate_in_kernel:
        return g
    if A_log is None and lower_bound is None:
        raise ValueError("A_log must be provided when use_gate_in_kernel=True and lower_bound is not set.")
    if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0), "
                         f"got {lower_bound}.")
    A_log = None if A_log is None else A_log.double()
    dt_bias = None if dt_bias is None else dt_bias.double()
    return kda_gate(g, A_log, dt_bias, lower_bound)


def _default_scale(scale, K):
    return K ** -0.5 if scale is None else scale


# ---------------------------------------------------------------------------
# Public ops (FLA 0.6.0 names and argument order)
# ---------------------------------------------------------------------------

def naive_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """DeltaNet: g = 0, scalar beta [B, T, H]."""
    HV = v.shape[2]
    q, k = _prep_qk(q, k, HV, use_qk_l2norm_in_kernel)
    beta = beta.double().unsqueeze(-1)
    g = torch.zeros_like(beta)
    return _run(q, k, v.double(), g, beta, beta, _default_scale(scale, q.shape[-1]),
                initial_state, output_final_state, False, cu_seqlens)


def naive_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None):
    """Gated DeltaNet: scalar g and beta of shape [B, T, HV]; v [B, T, HV, V]."""
    HV = v.shape[2]
    q, k = _prep_qk(q, k, HV, use_qk_l2norm_in_kernel)
    beta = _prep_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval).unsqueeze(-1)
    g = g.double()
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log must be provided when use_gate_in_kernel=True.")
        g = gdn_gate(g, A_log.double(), None if dt_bias is None else dt_bias.double())
    return _run(q, k, v.double(), g.unsqueeze(-1), beta, beta, _default_scale(scale, q.shape[-1]),
                initial_state, output_final_state, state_v_first, cu_seqlens)


def naive_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, state_v_first=False,
              cu_seqlens=None, A_log=None, dt_bias=None):
    """KDA: per-channel g [B, T, HV, K], scalar beta [B, T, HV]; v [B, T, HV, V].

    With use_gate_in_kernel, A_log has HV elements and dt_bias HV*K.
    """
    HV = v.shape[2]
    q, k = _prep_qk(q, k, HV, use_qk_l2norm_in_kernel)
    beta = _prep_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval).unsqueeze(-1)
    g = _prep_vector_gate(g, use_gate_in_kernel, safe_gate, lower_bound, A_log, dt_bias)
    return _run(q, k, v.double(), g, beta, beta, _default_scale(scale, q.shape[-1]),
                initial_state, output_final_state, state_v_first, cu_seqlens)


def naive_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None,
               safe_gate=False, lower_bound=None, state_v_first=False, A_log=None, dt_bias=None):
    """GDN2: q, k, g, b [B, T, H, K]; v, w [B, T, H, V] (no GVA)."""
    if v.shape[2] != q.shape[2]:
        raise ValueError(f"GDN2 has no GVA: v has {v.shape[2]} heads, q has {q.shape[2]}.")
    q, k = _prep_qk(q, k, v.shape[2], use_qk_l2norm_in_kernel)
    g = _prep_vector_gate(g, use_gate_in_kernel, safe_gate, lower_bound, A_log, dt_bias)
    return _run(q, k, v.double(), g, b.double(), w.double(), _default_scale(scale, q.shape[-1]),
                initial_state, output_final_state, state_v_first, cu_seqlens)
