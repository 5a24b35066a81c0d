"""FLA 0.6.0's local value gradient stage, launched by rewy.

Under policy ``full`` rewy's GDN / DeltaNet backward runs FLA's local value
gradient dV_loc = A_qk^T dO (``chunk_bwd_dv_local``) before the reverse state
recurrence (under ``recompute`` the fused prestage forms it). FLA's stage
function wraps the kernel in its backend dispatch, heuristics and caching
autotuner; here the output is allocated and the same kernel is launched with
the same arguments and grid through ``launch.launch``. The kernel is FLA's
own (imported, not copied).
"""

from __future__ import annotations

import torch
import triton

from .chunks import chunk_table
from .launch import launch


def dv_local(q, k, do, g=None, scale=None, chunk_size=64, cu_seqlens=None, chunk_indices=None):
    """The local value gradient A_qk^T dO of each chunk: FLA's ``chunk_bwd_dv_local``."""
    from fla.ops.common import chunk_o

    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    BT = chunk_size
    NT, chunk_indices = chunk_table(T, cu_seqlens, BT, chunk_indices)
    tiling = dv_local_tiling(q, k, do)
    BK = min(max(triton.next_power_of_2(K), 16), tiling)
    BV = min(max(triton.next_power_of_2(V), 16), tiling)
    dv = torch.empty_like(do)
    launch(chunk_o.chunk_bwd_kernel_dv_local, (NT, B * HV), q=q, k=k, g=g, g_gamma=None, A=None,
           do=do, dv=dv, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H,
           HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV)
    return dv


def dv_local_tiling(q, k, do) -> int:
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
