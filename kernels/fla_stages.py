"""Two of FLA 0.6.0's chunk-parallel stages, launched by rewy under REWY_HF_DIRECT_LAUNCH=1 (the default).

rewy's GDN / DeltaNet backward runs FLA's w/u recompute (policy recompute)
and its local value gradient dV_loc = A_qk^T dO. FLA's stage functions wrap
each kernel in its backend dispatch, then heuristics and its caching
autotuner; with the switch on, these functions allocate the outputs and
launch the same kernels with the same arguments and grid themselves, through
``direct_launch.launch``. With the switch off they are FLA's functions.
The kernels are FLA's own (imported, not copied).
"""

from __future__ import annotations

import torch
import triton

from . import direct_launch


def recompute_w_u(k, v, beta, A, g=None, cu_seqlens=None, chunk_indices=None):
    """w = A (beta k e^g), u = A (beta v) per chunk: FLA's ``recompute_w_u_fwd``."""
    from fla.ops.gated_delta_rule import wy_fast

    if not direct_launch.enabled():
        return wy_fast.recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g, cu_seqlens=cu_seqlens,
                                         chunk_indices=chunk_indices)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = A.shape[-1]
    NT, chunk_indices = chunk_table(T, cu_seqlens, BT, chunk_indices)
    w = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    # BK, BV: the fixed tiles FLA's recompute_w_u_fwd passes
    direct_launch.launch(wy_fast.recompute_w_u_fwd_kernel, (NT, B * HV), k=k, v=v, beta=beta, w=w, u=u, A=A, g=g,
                         cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, BT=BT,
                         BK=64, BV=64)
    return w, u


def dv_local(q, k, do, g=None, scale=None, chunk_size=64, cu_seqlens=None, chunk_indices=None):
    """The local value gradient A_qk^T dO of each chunk: FLA's ``chunk_bwd_dv_local``."""
    from fla.ops.common import chunk_o

    if not direct_launch.enabled():
        return chunk_o.chunk_bwd_dv_local(q=q, k=k, do=do, g=g, scale=scale, chunk_size=chunk_size,
                                          cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    BT = chunk_size
    NT, chunk_indices = chunk_table(T, cu_seqlens, BT, chunk_indices)
    tiling = _dv_local_tiling(q, k, do)
    BK = min(max(triton.next_power_of_2(K), 16), tiling)
    BV = min(max(triton.next_power_of_2(V), 16), tiling)
    dv = torch.empty_like(do)
    direct_launch.launch(chunk_o.chunk_bwd_kernel_dv_local, (NT, B * HV), q=q, k=k, g=g, g_gamma=None, A=None,
                         do=do, dv=dv, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H,
                         HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV)
    return dv


def chunk_table(T: int, cu_seqlens, chunk_size: int, chunk_indices):
    """(chunks in all, FLA's (sequence, chunk) table or None): with packed sequences each
    sequence's chunks are counted on their own, as FLA's stage functions count them; the
    table is built here when the caller has none."""
    if cu_seqlens is None:
        return triton.cdiv(T, chunk_size), chunk_indices
    if chunk_indices is None:
        from fla.ops.utils import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    return len(chunk_indices), chunk_indices


def _dv_local_tiling(q, k, do) -> int:
    """The tile cap FLA's ``chunk_bwd_dv_local`` picks from the device's shared memory."""
    from fla.utils import check_shared_mem

    index = k.device.index
    if check_shared_mem("hopper", index):
        return 128
    if check_shared_mem("ampere", index):
        return 128 if all(x.element_size() == 2 for x in (q, k, do)) else 64
    if check_shared_mem("ada", index):
        return 64
    return 32
