"""The Triton backend called directly, without the public ops' validation and activations.

``triton_gdn_core`` (DeltaNet, GDN), ``triton_kda_core`` and ``triton_gdn2_core`` take
activated inputs in FLA's layout and run them through the core's autograd boundary
(core.py) on the Triton backend. The interpreter tests and the GPU tests use them to
exercise the backend on its own.
"""

from __future__ import annotations

from .core import CoreArgs, delta_rule


def triton_gdn_core(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, policy,
                    cu_seqlens=None, qk_l2norm: bool = False):
    """GDN (g: [B, T, HV] log-decay) or DeltaNet (g None) on CUDA with the ReWY backward.
    ``cu_seqlens``: packed sequences in one row (B = 1), as in FLA. ``qk_l2norm``:
    q and k are normalised inside (FLA's ``use_qk_l2norm_in_kernel``)."""
    args = CoreArgs(q=q, k=k, v=v, g=g, beta=beta, w=None, h0=initial_state, cu_seqlens=cu_seqlens, scale=scale,
                    family="delta_rule" if g is None else "gdn", policy=policy, state_v_first=state_v_first,
                    qk_l2norm=qk_l2norm, safe_gate=False)
    o, ht = delta_rule(args, "triton")
    return o, (ht if output_final_state else None)


def _apply(q, k, v, g, beta, w_gate, scale, initial_state, output_final_state, state_v_first, policy, safe_gate,
           cu_seqlens, qk_l2norm):
    args = CoreArgs(q=q, k=k, v=v, g=g, beta=beta, w=w_gate, h0=initial_state, cu_seqlens=cu_seqlens, scale=scale,
                    family="kda" if w_gate is None else "gdn2", policy=policy, state_v_first=state_v_first,
                    qk_l2norm=qk_l2norm, safe_gate=safe_gate)
    o, ht = delta_rule(args, "triton")
    return o, (ht if output_final_state else None)


def triton_kda_core(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, policy, *,
                    safe_gate: bool = False, cu_seqlens=None, qk_l2norm: bool = False):
    """KDA on CUDA with the ReWY backward. Activated inputs in FLA's layout:
    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] natural-log per-token
    gates (<= 0); beta [B, T, HV]; initial_state [N, HV, K, V] ([N, HV, V, K]
    with ``state_v_first``). q, k and v must share one dtype (FLA's kernels).
    ``qk_l2norm``: q and k are normalised inside (FLA's ``use_qk_l2norm_in_kernel``)."""
    return _apply(q, k, v, g, beta, None, scale, initial_state, output_final_state, state_v_first, policy, safe_gate,
                  cu_seqlens, qk_l2norm)


def triton_gdn2_core(q, k, v, g, b, w, scale, initial_state, output_final_state, state_v_first, policy, *,
                     safe_gate: bool = False, cu_seqlens=None, qk_l2norm: bool = False):
    """GDN2 on CUDA with the ReWY backward: b [B, T, H, K] erase gate, w
    [B, T, H, V] write gate, no GVA (as in FLA 0.6.0); otherwise as
    ``triton_kda_core``."""
    if v.shape[2] != q.shape[2]:
        raise ValueError("GDN2 has no GVA in FLA 0.6.0: v must have as many heads as q")
    return _apply(q, k, v, g, b, w, scale, initial_state, output_final_state, state_v_first, policy, safe_gate,
                  cu_seqlens, qk_l2norm)
