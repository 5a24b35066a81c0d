"""FLA's sequential state recurrences, launched with a value-block width chosen per call.

FLA 0.6.0's ``chunk_gated_delta_rule_fwd_h`` and ``..._bwd_dhu`` run one
program per (sequence, value head, block of BV value columns); each walks its
sequence's chunks one after another. So the number of programs,
N x HV x V / BV, is all the parallelism these two stages have. FLA's
autotuner chooses BV among 64 and 32; with few sequences x heads even BV 32
leaves most of an H200's 132 SMs idle (64 programs at (1, 16384, 16)).

``narrow_block_v`` adds the width FLA does not try: BV 16 where BV 32 gives
fewer than MIN_PROGRAMS programs (and 16 gives more), e.g. one sequence of
16 heads. Everywhere else FLA's kernel runs at the width its own autotuner
picks. Both are launched here (``launch.launch``), without FLA's stage
function around the kernel. The measured effect of the rule is in
CHANGELOG.md.

The kernels are FLA's own (imported, not copied); only the launch is here.
num_warps and num_stages stay autotuned over FLA's own values, keyed on
FLA's key plus BV and the gate kind.
"""

from __future__ import annotations

import torch
import triton

from .chunks import chunk_count_and_offsets
from .launch import launch

NARROW = 16
# About one program per SM of an H200 (132): below that the sequential walk is the whole stage's time.
MIN_PROGRAMS = 128

# Built at first use (FLA is imported lazily); module-level so that the bench can find them and
# forget their autotune picks between shapes.
_fwd_h_kernel = None
_bwd_dhu_kernel = None


def narrow_block_v(sequences: int, value_heads: int, V: int) -> int | None:
    """16 where FLA's narrowest width (32) leaves fewer than MIN_PROGRAMS programs for
    N = ``sequences`` x HV = ``value_heads`` and 16 gives more; None (FLA's launch) elsewhere."""
    programs_32 = sequences * value_heads * triton.cdiv(V, 32)
    if programs_32 < MIN_PROGRAMS and triton.cdiv(V, NARROW) > triton.cdiv(V, 32):
        return NARROW
    return None


def _retuned(fla_kernel, key: list[str]):
    """FLA's kernel (heuristics around its autotuner around the jit function) with an
    autotuner of our own: FLA's (num_warps, num_stages) pairs, BV left to the caller."""
    tuner = fla_kernel.fn
    pairs = sorted({(c.num_warps, c.num_stages) for c in tuner.configs})
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in pairs]
    return triton.heuristics(fla_kernel.values)(triton.autotune(configs=configs, key=key)(tuner.fn))


def relaunched_kernels():
    """rewy's (fwd_h, bwd_dhu) kernel objects, built on first use (needs FLA)."""
    global _fwd_h_kernel, _bwd_dhu_kernel
    if _fwd_h_kernel is None:
        from fla.ops.common import chunk_delta_h as fla

        _fwd_h_kernel = _retuned(fla.chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
                                 ["H", "HV", "K", "V", "BT", "BV", "USE_G", "USE_GK", "STATE_V_FIRST"])
        _bwd_dhu_kernel = _retuned(fla.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64,
                                   ["H", "HV", "K", "V", "BT", "BV", "USE_G", "USE_GK", "STATE_V_FIRST"])
    return _fwd_h_kernel, _bwd_dhu_kernel


def fwd_h(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, chunk_size=64,
          state_v_first=False, cu_seqlens=None, chunk_indices=None, chunks=None):
    """h, v_new, final state, as FLA's ``chunk_gated_delta_rule_fwd_h`` returns them; ``chunks``:
    h's chunk dim that long (at least the call's chunks; the ones after them are not written)."""
    B, T, HV, V = u.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    bv = narrow_block_v(N, HV, V)
    K = k.shape[-1]
    NT, offsets = chunk_count_and_offsets(T, cu_seqlens, chunk_size, chunk_indices)
    state = (V, K) if state_v_first else (K, V)
    h = k.new_empty(B, NT if chunks is None else chunks, HV, *state)
    ht = k.new_zeros(N, HV, *state, dtype=torch.float32) if output_final_state else None
    v_new = torch.empty_like(u)
    kernel, grid, width = _kernel_and_grid(0, bv, N * HV, V)
    launch(
        kernel, grid, k=k, v=u, w=w, v_new=v_new, g=g, gk=gk, h=h, h0=initial_state, ht=ht, cu_seqlens=cu_seqlens,
        chunk_offsets=offsets, T=T, H=k.shape[2], HV=HV, K=K, V=V, BT=chunk_size, **width,
        STATE_V_FIRST=state_v_first)
    return h, v_new, ht


def bwd_dhu(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False,
            cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """dh, dh0, dv2, as FLA's ``chunk_gated_delta_rule_bwd_dhu`` returns them."""
    B, T, HV, V = do.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    bv = narrow_block_v(N, HV, V)
    K = q.shape[-1]
    NT, offsets = chunk_count_and_offsets(T, cu_seqlens, chunk_size, chunk_indices)
    dh = q.new_empty(B, NT, HV, *((V, K) if state_v_first else (K, V)))
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(dv)
    kernel, grid, width = _kernel_and_grid(1, bv, N * HV, V)
    launch(
        kernel, grid, q=q, k=k, w=w, g=g, gk=gk, dht=dht, dh0=dh0, do=do, dh=dh, dv=dv, dv2=dv2,
        cu_seqlens=cu_seqlens, chunk_offsets=offsets, scale=scale, T=T, H=q.shape[2], HV=HV, K=K, V=V,
        BT=chunk_size, **width, STATE_V_FIRST=state_v_first)
    return dh, dh0, dv2


def _kernel_and_grid(which: int, bv: int | None, programs_per_column: int, V: int):
    """(kernel, grid, width argument) of recurrence ``which`` (0: fwd_h, 1: bwd_dhu): rewy's relaunch
    at the width ``bv``, or FLA's own kernel, whose autotuner picks the width (BV), at ``bv`` None."""
    if bv is not None:
        return relaunched_kernels()[which], (triton.cdiv(V, bv) * programs_per_column,), {"BV": bv}
    from fla.ops.common import chunk_delta_h as fla

    kernel = (fla.chunk_gated_delta_rule_fwd_kernel_h_blockdim64, fla.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64)
    return kernel[which], lambda meta: (triton.cdiv(V, meta["BV"]) * programs_per_column,), {}
