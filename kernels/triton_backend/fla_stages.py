"""FLA 0.6.0's stages that rewy runs as they are, launched by rewy.

FLA's stage functions wrap each kernel in its backend dispatch, input guard,
heuristics and caching autotuner: about a tenth of a millisecond of host time
per launch, which at the bench's shapes is as long as many of these kernels
run. Here each output is allocated as FLA's function allocates it and FLA's
kernel is launched with the same arguments and grid through
``launch.launch``, which skips the autotuner once it holds a pick. FLA
0.6.0 registers no other CUDA backend for these functions (its TileLang,
FlashQLA and intra-card backends serve other ones), so the same kernels run
as through FLA's functions. The kernels are FLA's own (imported, not
copied).

- ``gate_cumsum``: the chunk-local cumulative gate (``chunk_local_cumsum``),
  scalar [B, T, H] or key-wise [B, T, H, K], always float32 out.
- ``gdn_intra``: GDN / DeltaNet's intra-chunk stage at chunk 64
  (``chunk_gated_delta_rule_fwd_intra``): A = (I + tril(beta K K^T))^-1
  gated, then the WY pair w, u (``recompute_w_u_fwd``).
- ``gdn_output``: GDN / DeltaNet's output (``chunk_fwd_o``).
- ``vector_output``: KDA / GDN2's output (``chunk_gla_fwd_o_gk``).
- ``kda_intra``: KDA's intra-chunk stage (``chunk_kda_fwd_intra``): Aqk and
  the diagonal blocks of Akk (sub-chunk kernel under ``safe_gate``, token-
  parallel kernel otherwise), the fused off-diagonal + solve kernel, then
  w, u, kg (and qg) as ``kda_recompute``.
- ``gdn2_intra`` / ``gdn2_recompute``: the same two for GDN2
  (``chunk_gdn2_fwd_intra``, ``recompute_w_u_fwd_gdn2``), with its erase
  gate b [B, T, H, K] and write gate w_gate [B, T, H, V].
- ``kda_recompute``: KDA's rebuild of w, u, kg (and qg) from Akk in the
  ``recompute`` backward (``recompute_w_u_fwd`` of ``fla.ops.kda``).
- ``vector_dAv``: KDA / GDN2's local dv with dAqk (``chunk_kda_bwd_dAv``).
- ``dv_local``: under policy ``full`` rewy's GDN / DeltaNet backward runs
  FLA's local value gradient dV_loc = A_qk^T dO (``chunk_bwd_dv_local``)
  before the reverse state recurrence (under ``recompute`` the fused
  prestage forms it).
"""

from __future__ import annotations

import torch
import triton

from .chunks import chunk_table
from .launch import launch


def gate_cumsum(g, scale=None, chunk_size=64, cu_seqlens=None, chunk_indices=None):
    """FLA's ``chunk_local_cumsum`` of g [B, T, H] or [B, T, H, S] (forward direction), float32."""
    from fla.ops.utils import cumsum

    B, T, H = g.shape[:3]
    NT, chunk_indices = chunk_table(T, cu_seqlens, chunk_size, chunk_indices)
    o = torch.empty_like(g, dtype=torch.float32)
    args = dict(s=g, o=o, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, B=B, H=H,
                BT=chunk_size, REVERSE=False, USE_GRAPH=False)
    if g.dim() == 3:
        launch(cumsum.chunk_local_cumsum_scalar_kernel, (NT * B * H,), **args)
    else:
        launch(cumsum.chunk_local_cumsum_vector_kernel, lambda meta: (triton.cdiv(meta["S"], meta["BS"]) * NT, B * H),
               **args, S=g.shape[3])
    return o


def gdn_intra(k, v, g, beta, cu_seqlens=None, chunk_indices=None):
    """w, u, A as FLA's ``chunk_gated_delta_rule_fwd_intra`` returns them at chunk 64 (its fused
    kkt + solve kernel, then ``recompute_w_u_fwd``); g: the log2 gate cumsum, None for DeltaNet."""
    from fla.ops.gated_delta_rule import chunk_fwd, wy_fast

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = 64
    NT, chunk_indices = chunk_table(T, cu_seqlens, BT, chunk_indices)
    A = torch.zeros(B, T, HV, BT, device=k.device, dtype=k.dtype)
    launch(chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel, (NT, B * HV), k=k, g=g, beta=beta, A=A,
           cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, BT=BT, BC=16)
    w = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    launch(wy_fast.recompute_w_u_fwd_kernel, (NT, B * HV), k=k, v=v, beta=beta, w=w, u=u, A=A, g=g,
           cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64)
    return w, u, A


def gdn_output(q, k, v, h, g, scale, chunk_size=64, cu_seqlens=None, chunk_indices=None):
    """o as FLA's ``chunk_fwd_o`` returns it (K-first states h)."""
    from fla.ops.common import chunk_o

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT, chunk_indices = chunk_table(T, cu_seqlens, chunk_size, chunk_indices)
    o = torch.empty_like(v)
    launch(chunk_o.chunk_fwd_kernel_o, lambda meta: (triton.cdiv(V, meta["BV"]) * NT, B * HV), q=q, k=k, v=v, h=h,
           g=g, g_gamma=None, o=o, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H,
           HV=HV, K=K, V=V, BT=chunk_size, STATE_V_FIRST=False)
    return o


def vector_output(q, v, g, A, h, scale, state_v_first=False, chunk_size=64, cu_seqlens=None, chunk_indices=None):
    """o as FLA's ``chunk_gla_fwd_o_gk`` returns it (zero-initialised, as FLA allocates it)."""
    from fla.ops.gla import chunk as gla

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT, chunk_indices = chunk_table(T, cu_seqlens, chunk_size, chunk_indices)
    o = torch.zeros_like(v)
    launch(gla.chunk_gla_fwd_kernel_o, lambda meta: (triton.cdiv(V, meta["BV"]) * NT, B * HV), q=q, v=v, g=g, h=h,
           o=o, A=A, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V,
           BT=chunk_size, STATE_V_FIRST=state_v_first, USE_GRAPH=False)
    return o


def _intra_buffers(k, heads: int, cu_seqlens, chunk_indices):
    """NT, FLA's chunk table and the outputs of KDA's and GDN2's intra-chunk stage as FLA allocates them:
    Aqk, Akk (zeroed: only its lower triangle is written) and the diagonal blocks Akkd."""
    B, T = k.shape[:2]
    NT, chunk_indices = chunk_table(T, cu_seqlens, 64, chunk_indices)
    Aqk = k.new_empty(B, T, heads, 64)
    Akk = torch.zeros(B, T, heads, 64, device=k.device, dtype=k.dtype)
    Akkd = k.new_empty(B, T, heads, 16, dtype=torch.float32)
    return NT, chunk_indices, Aqk, Akk, Akkd


def kda_intra(q, k, v, gk, beta, scale, safe_gate=False, disable_recompute=False, cu_seqlens=None,
              chunk_indices=None):
    """w, u, qg (None unless ``disable_recompute``), kg, Aqk, Akk as FLA's ``chunk_kda_fwd_intra`` returns
    them at chunk 64 (no lower bound given: its default gate shift)."""
    from fla.ops.kda import chunk_intra, chunk_intra_token_parallel
    from fla.ops.utils.constant import RCP_LN2
    from fla.utils import IS_GATHER_SUPPORTED

    B, T, H, K = k.shape
    HV = gk.shape[2]
    BT, BC = 64, 16
    NT, chunk_indices, Aqk, Akk, Akkd = _intra_buffers(k, HV, cu_seqlens, chunk_indices)
    if safe_gate:
        launch(chunk_intra.chunk_kda_fwd_kernel_intra_sub_chunk, (NT, BT // BC, B * HV), q=q, k=k, g=gk, beta=beta,
               Aqk=Aqk, Akk=Akkd, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV,
               K=K, BT=BT, BC=BC, BK=triton.next_power_of_2(K), GATE_SHIFT=2.0 * RCP_LN2,
               USE_GATHER=IS_GATHER_SUPPORTED, USE_GRAPH=False)
    else:
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        launch(chunk_intra_token_parallel.chunk_kda_fwd_kernel_intra_token_parallel,
               lambda meta: (B * T, triton.cdiv(HV, meta["BH"])), q=q, k=k, g=gk, beta=beta, Aqk=Aqk, Akk=Akkd,
               scale=scale, cu_seqlens=cu_seqlens, N=N, T=T, H=H, HV=HV, K=K, BK=triton.next_power_of_2(K), BT=BT,
               BC=BC, USE_GRAPH=False)
    launch(chunk_intra.chunk_kda_fwd_kernel_inter_solve_fused, (NT, B * HV), q=q, k=k, g=gk, beta=beta, Aqk=Aqk,
           Akkd=Akkd, Akk=Akk, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV,
           K=K, BT=BT, BC=BC, NC=BT // BC, USE_SAFE_GATE=safe_gate, USE_GRAPH=False)
    w, u, qg, kg = kda_recompute(k, v, beta, Akk, gk, q=q if disable_recompute else None, cu_seqlens=cu_seqlens,
                                 chunk_indices=chunk_indices)
    return w, u, qg, kg, Aqk, Akk


def gdn2_intra(q, k, v, gk, b, w_gate, scale, safe_gate=False, disable_recompute=False, cu_seqlens=None,
               chunk_indices=None):
    """w, u, qg (None unless ``disable_recompute``), kg, Aqk, Akk as FLA's ``chunk_gdn2_fwd_intra`` returns
    them at chunk 64 (no lower bound given: its default gate shift)."""
    from fla.ops.gdn2 import chunk_intra, chunk_intra_token_parallel
    from fla.ops.utils.constant import RCP_LN2
    from fla.utils import IS_GATHER_SUPPORTED

    B, T, H, K = k.shape
    BT, BC = 64, 16
    NT, chunk_indices, Aqk, Akk, Akkd = _intra_buffers(k, H, cu_seqlens, chunk_indices)
    if safe_gate:
        launch(chunk_intra.chunk_gdn2_fwd_kernel_intra_sub_chunk, (NT, BT // BC, B * H), q=q, k=k, g=gk, b=b,
               Aqk=Aqk, Akk=Akkd, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, K=K,
               BT=BT, BC=BC, BK=triton.next_power_of_2(K), USE_GATHER=IS_GATHER_SUPPORTED, GATE_SHIFT=2.0 * RCP_LN2)
    else:
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        launch(chunk_intra_token_parallel.chunk_gdn2_fwd_kernel_intra_token_parallel,
               lambda meta: (B * T, triton.cdiv(H, meta["BH"])), q=q, k=k, g=gk, b=b, Aqk=Aqk, Akk=Akkd, scale=scale,
               cu_seqlens=cu_seqlens, N=N, T=T, H=H, K=K, BK=triton.next_power_of_2(K), BT=BT, BC=BC)
    launch(chunk_intra.chunk_gdn2_fwd_kernel_inter_solve_fused, (NT, B * H), q=q, k=k, g=gk, b=b, Aqk=Aqk,
           Akkd=Akkd, Akk=Akk, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, K=K, BT=BT,
           BC=BC, USE_SAFE_GATE=safe_gate)
    w, u, qg, kg = gdn2_recompute(k, v, b, w_gate, Akk, gk, q=q if disable_recompute else None,
                                  cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    return w, u, qg, kg, Aqk, Akk


def gdn2_recompute(k, v, b, w_gate, A, gk, q=None, cu_seqlens=None, chunk_indices=None):
    """w, u, qg (None without q), kg as FLA's ``recompute_w_u_fwd_gdn2`` returns them."""
    from fla.ops.gdn2 import wy_fast

    B, T, H, K = k.shape
    V = v.shape[3]
    BT = A.shape[-1]
    NT, chunk_indices = chunk_table(T, cu_seqlens, BT, chunk_indices)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    qg = torch.empty_like(q) if q is not None else None
    kg = torch.empty_like(k)
    launch(wy_fast.recompute_w_u_fwd_gdn2_kernel, (NT, B * H), q=q, k=k, qg=qg, kg=kg, v=v, b=b, w_gate=w_gate, w=w,
           u=u, A=A, gk=gk, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, K=K, V=V, BT=BT, BK=64,
           BV=64)
    return w, u, qg, kg


def kda_recompute(k, v, beta, A, gk, q=None, cu_seqlens=None, chunk_indices=None):
    """w, u, qg (None without q), kg as KDA's ``recompute_w_u_fwd`` returns them."""
    from fla.ops.kda import wy_fast

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = A.shape[-1]
    NT, chunk_indices = chunk_table(T, cu_seqlens, BT, chunk_indices)
    w = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    qg = k.new_empty(B, T, HV, K) if q is not None else None
    kg = k.new_empty(B, T, HV, K)
    launch(wy_fast.recompute_w_u_fwd_kda_kernel, (NT, B * HV), q=q, k=k, qg=qg, kg=kg, v=v, beta=beta, w=w, u=u,
           A=A, gk=gk, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BK=64,
           BV=64, USE_GRAPH=False)
    return w, u, qg, kg


def vector_dAv(q, k, v, do, A, scale, chunk_size=64, cu_seqlens=None, chunk_indices=None):
    """dAqk (float32), dv as FLA's ``chunk_kda_bwd_dAv`` returns them."""
    from fla.ops.kda import chunk_bwd
    from fla.utils import check_shared_mem

    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    NT, chunk_indices = chunk_table(T, cu_seqlens, chunk_size, chunk_indices)
    tiling = 128 if check_shared_mem("hopper", k.device.index) else 64     # FLA's two cases on a GPU
    BK = min(max(triton.next_power_of_2(K), 16), tiling)
    BV = min(max(triton.next_power_of_2(V), 16), tiling)
    dA = v.new_empty(B, T, HV, chunk_size, dtype=torch.float)
    dv = torch.empty_like(do)
    launch(chunk_bwd.chunk_kda_bwd_kernel_dAv, (NT, B * HV), q=q, k=k, v=v, A=A, do=do, dv=dv, dA=dA,
           cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V,
           BT=chunk_size, BK=BK, BV=BV, USE_GRAPH=False)
    return dA, dv


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
