"""The triton backend for GDN and DeltaNet (CUDA).

Forward: FLA 0.6.0's stage functions, called in FLA's order (chunk-local gate
cumsum in log2 units, the intra-chunk WY pair w, u and A, the state recurrence
h / v_new, the output). Backward: FLA's stages that ReWY leaves alone (w/u
recompute, the state recurrence, the local dv and the reverse state
recurrence dh / dv2; under ``recompute`` the w/u recompute and the local dv
run as one kernel of rewy's, triton_gdn_prestage.py, unless
REWY_HF_FUSED_PRESTAGE=0), then rewy's own kernel for everything ReWY
rewrites (triton_gdn_bwd.py), which also replaces FLA's ``chunk_bwd_dqkwg``,
the kernel FLA 0.6.0 refuses to run on Hopper with Triton < 3.7.1.

Policies: ``recompute`` saves A (as FLA does) and rebuilds w, u, h, v_new --
h from the state checkpoints of ``state_checkpoints.py`` (h at the first
chunk of every segment, a few MB) in parallel along the sequence where
FLA's sequential rebuild would leave most SMs idle;
``full`` saves w, h and v_new (u is not needed: the ReWY kernel reads neither
w nor u, and the reverse state recurrence needs only w). ``cu_seqlens``
(packed sequences) goes to every FLA stage and to our kernel. With
REWY_HF_SEQUENCE_PARALLEL set, the two state recurrences run split along the
sequence (triton_state_scan.py) instead of FLA's sequential kernels. With
``qk_l2norm`` q and k are normalised inside the function (qk_l2norm.py), as
FLA's op does; the gate and beta arrive activated. Layout [B, T, H, D]; the
state is [N, HV, K, V].
"""

from __future__ import annotations

import torch

from . import fla_stages, state_checkpoints, state_launch, triton_gdn_prestage, triton_gdn_walk
from .qk_l2norm import normalize, normalize_backward
from .triton_gdn_bwd import rewy_gdn_bwd_local
from .triton_state_scan import sequence_segments, state_backward, state_forward

RCP_LN2 = 1.4426950408889634


def _fla():
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices

    return dict(fwd_h=chunk_gated_delta_rule_fwd_h, bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
                fwd_o=chunk_fwd_o, intra=chunk_gated_delta_rule_fwd_intra,
                cumsum=chunk_local_cumsum, chunk_indices=prepare_chunk_indices)


def _states(f, ns, k, w, u, g2, h0, pk, final: bool):
    """h, v_new, final state: split along the sequence when ns > 1, else FLA's sequential kernel."""
    if ns > 1:
        return state_forward(k, w, u, g2, h0, ns)
    return state_launch.fwd_h(f["fwd_h"], k=k, w=w, u=u, g=g2, initial_state=h0, output_final_state=final,
                              chunk_size=64, **pk)


def _rebuild(ctx, f, saved, ns, k, w, u, g2, h0, pk):
    """h and v_new again under ``recompute``: from the forward's state checkpoints when it kept them."""
    if ctx.segments is not None:
        return state_checkpoints.rebuild(f["fwd_h"], saved[0], ctx.segments, u, k=k, w=w, g=g2)
    h, v_new, _ = _states(f, ns, k, w, u, g2, h0, pk, final=False)
    return h, v_new


def fold_gva(dq, dk, key_heads: int):
    """dq, dk computed per value head [B, T, HV, K] -> per key head [B, T, H, K]:
    under GVA each key head serves HV // H value heads, so their gradients add."""
    B, T, HV, K = dq.shape
    group = HV // key_heads
    if group == 1:
        return dq, dk
    return dq.view(B, T, key_heads, group, K).sum(3), dk.view(B, T, key_heads, group, K).sum(3)


class ReWYTritonGDNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale: float, policy: str, cu_seqlens, qk_l2norm: bool = False):
        f = _fla()
        q, q_rstd = normalize(q, qk_l2norm)
        k, k_rstd = normalize(k, qk_l2norm)
        # Every FLA stage takes the same packing arguments; chunk_indices is built once here.
        pk = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens,
                                                chunk_indices=f["chunk_indices"](cu_seqlens, 64))
        g2 = None if g is None else f["cumsum"](g.float(), chunk_size=64, scale=RCP_LN2, **pk)
        w, u, A = f["intra"](k=k, v=v, g=g2, beta=beta, chunk_size=64, **pk)
        ns = sequence_segments(k, v, cu_seqlens)
        h, v_new, ht = _states(f, ns, k, w, u, g2, h0, pk, final=True)
        o = f["fwd_o"](q=q, k=k, v=v_new, h=h, g=g2, scale=scale, chunk_size=64, **pk)
        # The opt-in sequence split (ns > 1) keeps its own rebuild, as it was timed.
        segments = state_checkpoints.plan(v, cu_seqlens) if policy == "recompute" and ns == 1 else None
        if policy == "full":
            saved = (w, h, v_new)
        else:
            saved = () if segments is None else (state_checkpoints.save(h, h0, segments),)
        ctx.save_for_backward(q, k, v, g2, beta, A, h0, q_rstd, k_rstd, *pk.values(), *saved)
        ctx.meta = (scale, policy, g is not None, h0 is not None, cu_seqlens is not None, ns)
        ctx.segments = segments
        return o.to(v.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        scale, policy, has_g, has_h0, varlen, ns = ctx.meta
        q, k, v, g2, beta, A, h0, q_rstd, k_rstd, *rest = ctx.saved_tensors
        pk = dict(cu_seqlens=rest[0], chunk_indices=rest[1]) if varlen else {}
        saved = rest[2:] if varlen else rest
        f = _fla()
        do = do.contiguous()
        # rewy's reverse walk forms the local dv itself from the prestage's S^T where the GPU is full
        # (REWY_HF_GDN_WALK); not with the sequence split.
        prestage = triton_gdn_prestage.enabled()
        walk = policy != "full" and ns == 1 and triton_gdn_walk.chosen(k, v, pk.get("cu_seqlens"), prestage)
        dv_local = u = st = None
        if policy == "full":
            w, h, v_new = saved
        elif walk:
            w, u, st = triton_gdn_prestage.recompute_wu_and_scores(q, k, v, beta, A, g=g2, scale=scale,
                                                                   dtype=do.dtype, **pk)
        elif prestage:
            w, u, dv_local = triton_gdn_prestage.recompute_wu_and_dv_local(q, k, v, beta, A, do, g=g2,
                                                                           scale=scale, **pk)
        else:
            w, u = fla_stages.recompute_w_u(k=k, v=v, beta=beta, A=A, g=g2, **pk)
        if policy != "full":
            h, v_new = _rebuild(ctx, f, saved, ns, k, w, u, g2, h0, pk)
            u = None                                   # freed before the reverse recurrence allocates dh
        dht = None if dht is None else dht.contiguous()
        if walk:
            dh, dh0, dv2 = triton_gdn_walk.reverse_walk(q, k, w, st, do, g=g2, h0=h0, dht=dht, scale=scale, **pk)
            st = None
        else:
            if dv_local is None:
                dv_local = fla_stages.dv_local(q=q, k=k, do=do, g=g2, scale=scale, chunk_size=64, **pk)
            if ns > 1:
                dh, dh0, dv2 = state_backward(q, k, w, do, dv_local, g2, dht, scale, ns)
            else:
                dh, dh0, dv2 = state_launch.bwd_dhu(f["bwd_dhu"], q=q, k=k, w=w, do=do, dv=dv_local, g=g2, h0=h0,
                                                    dht=dht, scale=scale, chunk_size=64, **pk)
            dv_local = None                            # dv2 holds it now; freed before the local kernel's outputs
        dq, dk, dv, dg, db = rewy_gdn_bwd_local(q, k, v, v_new, g2, beta, A, h, dh, do, dv2, scale=scale, **pk)
        dq, dk = fold_gva(dq, dk, q.shape[2])
        dq, dk = normalize_backward(q, q_rstd, dq), normalize_backward(k, k_rstd, dk)
        return (dq, dk, dv.to(v.dtype), dg if has_g else None, db.to(beta.dtype),
                dh0 if has_h0 else None, None, None, None, None)


def triton_gdn_core(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, policy,
                    cu_seqlens=None, qk_l2norm: bool = False):
    """GDN (g: [B, T, HV] log-decay) or DeltaNet (g None) on CUDA with the ReWY backward.
    ``cu_seqlens``: packed sequences in one row (B = 1), as in FLA. ``qk_l2norm``:
    q and k are normalised inside (FLA's ``use_qk_l2norm_in_kernel``)."""
    h0 = None
    if initial_state is not None:
        h0 = (initial_state.transpose(-1, -2) if state_v_first else initial_state).float().contiguous()
    o, ht = ReWYTritonGDNFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                        None if g is None else g.contiguous(), beta.contiguous(), h0, scale, policy,
                                        cu_seqlens, qk_l2norm)
    if not output_final_state:
        return o, None
    return o, (ht.transpose(-1, -2) if state_v_first else ht)
