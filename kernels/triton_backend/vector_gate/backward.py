"""The local ReWY backward of KDA and GDN2 (vector gates): two Triton kernels in sequence.

They replace FLA 0.6.0's ``chunk_kda_bwd_kernel_wy_dqkg_fused`` and
``chunk_kda_bwd_kernel_intra`` (and their GDN2 twins) and the final
``chunk_local_cumsum``. They take what FLA's sequential stages produce: the
states ``h`` entering each chunk, the gradients ``dh`` of the states leaving
it, ``v_new`` = Vn and its full gradient ``dv2`` = dVn
(``chunk_gated_delta_rule_bwd_dhu``), and ``dAqk`` = scale * causal(dO Vn^T)
(``chunk_kda_bwd_dAv``).

1. wy_backward.py: Residual WY and the inter-chunk dq / dk / dg terms.
2. intra_backward.py: the intra-chunk Gram backward by Matrix Intra, with
   Gram Elimination for the gate gradient and its reverse cumulative sum.

Layout: FLA's [B, T, heads, D] token layout, ``cu_seqlens`` varlen through
FLA's ``chunk_indices``, states [B, NT, HV, K, V] (or [.., V, K] with
``state_v_first``). Plain pointer arithmetic with masks throughout (no block
pointers), so the same code runs under Triton's CPU interpreter.
"""

from __future__ import annotations

from ...constants import CHUNK
from ..chunks import chunk_table
from . import common
from .intra_backward import rewy_kda_bwd_intra
from .wy_backward import rewy_kda_bwd_wy


def rewy_kda_bwd(q, k, v, v_new, g, beta, A, h, dh, do, dv2, dAqk, scale: float, w_gate=None,
                 state_v_first: bool = False, cu_seqlens=None, chunk_indices=None, block_k: int | None = None,
                 final_dtypes: bool = False, intra_block_k: int | None = None):
    """Both stages. Returns (dq, dk, dv, dg, db, dw): dq, dk, dg, db in fp32, dq
    and dk per value head ([B, T, HV, K]; the caller sums GVA groups); dv, dw
    in the dtypes of v and w_gate (dw None for KDA). ``final_dtypes`` (only
    without GVA, where dq and dk per value head are already final): dq, dk in
    q's dtype and GDN2's db in b's, written so by the kernel. ``block_k`` /
    ``intra_block_k``: key channels per program of stage 1 / stage 2."""
    if final_dtypes and q.shape[2] != v.shape[2]:
        raise ValueError("final_dtypes needs as many q/k heads as v heads: under GVA dq and dk are summed later")
    args = [t.contiguous() for t in (q, k, v, v_new, g, beta, A, h, dh, do, dv2)]
    q, k, v, v_new, g, beta, A, h, dh, do, dv2 = args
    w_gate = None if w_gate is None else w_gate.contiguous()
    if cu_seqlens is not None and chunk_indices is None:
        _, chunk_indices = chunk_table(q.shape[1], cu_seqlens, CHUNK, None)
    dq, dk, dG, dv, dw, db, dL = rewy_kda_bwd_wy(q, k, v, v_new, g, beta, A, h, dh, do, dv2, scale, w_gate,
                                                  state_v_first, cu_seqlens, chunk_indices, block_k)
    dq, dk, dg, db = rewy_kda_bwd_intra(q, k, g, beta, dAqk.contiguous(), dL, dq, dk, dG, db, cu_seqlens,
                                        chunk_indices, block_k=intra_block_k,
                                        dqk_dtype=common.narrow_dtype(q.dtype) if final_dtypes else None,
                                        db_dtype=common.narrow_dtype(beta.dtype) if final_dtypes else None)
    return dq, dk, dv, dg, db, dw
