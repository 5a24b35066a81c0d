"""The triton backend for KDA and GDN2 (CUDA).

Forward: FLA 0.6.0's stage functions in FLA's order: the chunk-local gate
cumsum in log2 units (``chunk_local_cumsum``), the intra-chunk stage
(``chunk_kda_fwd_intra`` / ``chunk_gdn2_fwd_intra``: Aqk, A = Akk, w, u,
and kg, qg), the state recurrence (``chunk_gated_delta_rule_fwd_h``: the
states h entering each chunk, v_new) and the output (``chunk_gla_fwd_o_gk``).

Backward: FLA's stages that ReWY leaves alone -- the w/u/qg/kg recompute and
the state recurrence forward (``recompute`` policy only), the local dv with
dAqk (``chunk_kda_bwd_dAv``, shared by KDA and GDN2 in FLA) and the reverse
state recurrence (``chunk_gated_delta_rule_bwd_dhu``) -- then rewy's two
kernels (triton_kda_bwd.py) for what ReWY rewrites: Residual WY plus the
inter-chunk dq/dk/dg terms, and the intra-chunk Gram backward by Matrix Intra
with the gate's reverse cumulative sum. They replace FLA's
``chunk_kda_bwd_kernel_wy_dqkg_fused``, ``chunk_kda_bwd_kernel_intra`` and
the final ``chunk_local_cumsum`` (and their GDN2 twins).

Policies: ``recompute`` saves what FLA's default saves (inputs, the log2 gate
cumsum, Aqk, Akk) and rebuilds w, qg, kg, h and v_new -- h from the state
checkpoints of ``state_checkpoints.py`` where FLA's sequential rebuild would
leave most SMs idle; ``full`` (FLA's
``disable_recompute=True``) also saves w, qg, kg, v_new and h -- but not u,
which our backward never reads (Residual WY needs only Vn).

With ``qk_l2norm`` q and k are normalised inside the function
(qk_l2norm.py), as FLA's op does; the gate activation and beta sigmoid are
plain torch ops in the caller. Layout: FLA's [B, T, heads, D]; gates are
natural-log per-token gates, [B, T, HV, K]. The state layout
(``state_v_first``) and ``cu_seqlens`` are handled natively by FLA's stages
and by our kernels, so no transposes or repacking happen here.
"""

from __future__ import annotations

import torch

from . import state_checkpoints, state_launch
from .qk_l2norm import normalize, normalize_backward
from .triton_gdn import RCP_LN2, fold_gva
from .triton_kda_bwd import rewy_kda_bwd
from .triton_state_scan import sequence_segments, state_backward, state_forward

CHUNK = 64


def _fla(kind: str) -> dict:
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices

    if kind == "kda":
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra as intra
        from fla.ops.kda.wy_fast import recompute_w_u_fwd as recompute
    else:
        from fla.ops.gdn2.chunk_intra import chunk_gdn2_fwd_intra as intra
        from fla.ops.gdn2.wy_fast import recompute_w_u_fwd_gdn2 as recompute
    return dict(fwd_h=chunk_gated_delta_rule_fwd_h, bwd_dhu=chunk_gated_delta_rule_bwd_dhu, fwd_o=chunk_gla_fwd_o_gk,
                dAv=chunk_kda_bwd_dAv, cumsum=chunk_local_cumsum, chunk_indices=prepare_chunk_indices,
                intra=intra, recompute=recompute)


def _intra(f, kind, q, k, v, g2, beta, w_gate, scale, cu, ci, safe_gate, full):
    if kind == "kda":
        return f["intra"](q=q, k=k, v=v, gk=g2, beta=beta, scale=scale, cu_seqlens=cu, chunk_size=CHUNK,
                          chunk_indices=ci, safe_gate=safe_gate, disable_recompute=full)
    return f["intra"](q=q, k=k, v=v, gk=g2, b=beta, w_gate=w_gate, scale=scale, cu_seqlens=cu, chunk_size=CHUNK,
                      chunk_indices=ci, safe_gate=safe_gate, disable_recompute=full)


def _recompute(f, kind, q, k, v, g2, beta, w_gate, Akk, cu, ci):
    if kind == "kda":
        return f["recompute"](k=k, v=v, beta=beta, A=Akk, gk=g2, q=q, cu_seqlens=cu, chunk_indices=ci)
    return f["recompute"](k=k, v=v, b=beta, w_gate=w_gate, A=Akk, q=q, gk=g2, cu_seqlens=cu, chunk_indices=ci)


def _states(f, ns, kg, w, u, g2, h0, state_v_first, cu, ci, final: bool):
    """h, v_new, final state: split along the sequence when ns > 1, else FLA's sequential kernel."""
    if ns > 1:
        return state_forward(kg, w, u, None, h0, ns, gk=g2)
    return state_launch.fwd_h(f["fwd_h"], k=kg, w=w, u=u, gk=g2, initial_state=h0, output_final_state=final,
                              chunk_size=CHUNK, state_v_first=state_v_first, cu_seqlens=cu, chunk_indices=ci)


class ReWYTritonKDAFunction(torch.autograd.Function):
    """o, ht = f(q, k, v, g, beta, w_gate, h0). KDA: beta [B, T, HV], w_gate None.
    GDN2: beta is the erase gate b [B, T, H, K], w_gate the write gate [B, T, H, V]."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, w_gate, h0, scale: float, policy: str, state_v_first: bool,
                safe_gate: bool, cu_seqlens, qk_l2norm: bool = False):
        kind = "kda" if w_gate is None else "gdn2"
        f = _fla(kind)
        q, q_rstd = normalize(q, qk_l2norm)
        k, k_rstd = normalize(k, qk_l2norm)
        ctx.set_materialize_grads(False)   # no zero dht when the final state is unused
        full = policy == "full"
        ci = None if cu_seqlens is None else f["chunk_indices"](cu_seqlens, CHUNK)
        g2 = f["cumsum"](g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=ci)
        w, u, qg, kg, Aqk, Akk = _intra(f, kind, q, k, v, g2, beta, w_gate, scale, cu_seqlens, ci, safe_gate, full)
        ns = sequence_segments(k, v, cu_seqlens, state_v_first)
        h, v_new, ht = _states(f, ns, kg, w, u, g2, h0, state_v_first, cu_seqlens, ci, final=True)
        o = f["fwd_o"](q=q, v=v_new, g=g2, A=Aqk, h=h, scale=scale, state_v_first=state_v_first,
                       cu_seqlens=cu_seqlens, chunk_size=CHUNK, chunk_indices=ci)
        # The opt-in sequence split (ns > 1) keeps its own rebuild, as it was timed.
        segments = state_checkpoints.plan(v, cu_seqlens) if not full and ns == 1 else None
        if full:
            saved = (w, qg, kg, v_new, h)
        else:
            saved = () if segments is None else (state_checkpoints.save(h, h0, segments),)
        ctx.save_for_backward(q, k, v, g2, beta, w_gate, Aqk, Akk, h0, cu_seqlens, ci, q_rstd, k_rstd, *saved)
        ctx.meta = (kind, scale, policy, state_v_first, g.dtype, ns)
        ctx.segments = segments
        return o.to(v.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        kind, scale, policy, state_v_first, g_dtype, ns = ctx.meta
        q, k, v, g2, beta, w_gate, Aqk, Akk, h0, cu, ci, q_rstd, k_rstd, *saved = ctx.saved_tensors
        f = _fla(kind)
        do = torch.zeros(*v.shape[:-1], v.shape[-1], dtype=v.dtype, device=v.device) if do is None else do.contiguous()
        if policy == "full":
            w, qg, kg, v_new, h = saved
        else:
            w, u, qg, kg = _recompute(f, kind, q, k, v, g2, beta, w_gate, Akk, cu, ci)
            if ctx.segments is not None:
                h, v_new = state_checkpoints.rebuild(f["fwd_h"], saved[0], ctx.segments, u, k=kg, w=w, gk=g2,
                                                     state_v_first=state_v_first)
            else:
                h, v_new, _ = _states(f, ns, kg, w, u, g2, h0, state_v_first, cu, ci, final=False)
            u = None                                   # freed before the reverse recurrence allocates dh
        dAqk, dv_local = f["dAv"](q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu,
                                  chunk_size=CHUNK, chunk_indices=ci)
        dht = None if dht is None else dht.contiguous()
        if ns > 1:      # the sequence-parallel recurrences (opt-in, see triton_state_scan.py)
            dh, dh0, dv2 = state_backward(qg, kg, w, do, dv_local, None, dht, scale, ns, gk=g2)
        else:
            dh, dh0, dv2 = state_launch.bwd_dhu(f["bwd_dhu"], q=qg, k=kg, w=w, do=do, dv=dv_local, gk=g2, h0=h0,
                                                dht=dht, scale=scale, state_v_first=state_v_first, cu_seqlens=cu,
                                                chunk_size=CHUNK, chunk_indices=ci)
        dv_local = None                                # dv2 holds it now; freed before the local kernels' outputs
        # Without GVA the kernel writes dq, dk (and GDN2's db) in the input dtypes: no conversion pass after it.
        dq, dk, dv, dg, db, dw = rewy_kda_bwd(q, k, v, v_new, g2, beta, Akk, h, dh, do, dv2, dAqk, scale,
                                              w_gate=w_gate, state_v_first=state_v_first, cu_seqlens=cu,
                                              chunk_indices=ci, final_dtypes=q.shape[2] == v.shape[2])
        dq, dk = fold_gva(dq, dk, q.shape[2])
        dq, dk = normalize_backward(q, q_rstd, dq), normalize_backward(k, k_rstd, dk)
        return (dq, dk, dv.to(v.dtype), dg.to(g_dtype), db.to(beta.dtype),
                None if dw is None else dw.to(w_gate.dtype), dh0 if h0 is not None else None,
                None, None, None, None, None, None)


def _state(initial_state):
    return None if initial_state is None else initial_state.float().contiguous()


def triton_kda_core(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, policy, *,
                    safe_gate: bool = False, cu_seqlens=None, qk_l2norm: bool = False):
    """KDA on CUDA with the ReWY backward. Activated inputs in FLA's layout:
    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] natural-log per-token
    gates (<= 0); beta [B, T, HV]; initial_state [N, HV, K, V] ([N, HV, V, K]
    with ``state_v_first``). q, k and v must share one dtype (FLA's kernels).
    ``qk_l2norm``: q and k are normalised inside (FLA's ``use_qk_l2norm_in_kernel``)."""
    o, ht = ReWYTritonKDAFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                        beta.contiguous(), None, _state(initial_state), scale, policy,
                                        state_v_first, safe_gate, cu_seqlens, qk_l2norm)
    return o, (ht if output_final_state else None)


def triton_gdn2_core(q, k, v, g, b, w, scale, initial_state, output_final_state, state_v_first, policy, *,
                     safe_gate: bool = False, cu_seqlens=None, qk_l2norm: bool = False):
    """GDN2 on CUDA with the ReWY backward: b [B, T, H, K] erase gate, w
    [B, T, H, V] write gate, no GVA (as in FLA 0.6.0); otherwise as
    ``triton_kda_core``."""
    if v.shape[2] != q.shape[2]:
        raise ValueError("GDN2 has no GVA in FLA 0.6.0: v must have as many heads as q")
    o, ht = ReWYTritonKDAFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                        b.contiguous(), w.contiguous(), _state(initial_state), scale, policy,
                                        state_v_first, safe_gate, cu_seqlens, qk_l2norm)
    return o, (ht if output_final_state else None)
