"""FLA's sequential state recurrences, launched with a value-block width chosen per call.

FLA 0.6.0's ``chunk_gated_delta_rule_fwd_h`` and ``..._bwd_dhu`` run one
program per (sequence, value head, block of BV value columns); each walks its
sequence's chunks one after another. So the number of programs,
N x HV x V / BV, is all the parallelism these two stages have. FLA's
autotuner chooses BV among 64 and 32; with few sequences x heads even BV 32
leaves most of an H200's 132 SMs idle (64 programs at (1, 16384, 16)).

``narrow_block_v`` adds the width FLA does not try: BV 16 where BV 32 gives
fewer than MIN_PROGRAMS programs (and 16 gives more). Everywhere else FLA's
own launch runs, unchanged. Timed on the H200 at the six bench shapes
(eleventh session, ``benchmarks/timing_gaps.py --state-widths``), the rule picks the
fastest launch (or one tied with it) at all six, KDA and GDN gates: at (1, 16384, 16) BV 16 takes
0.349 / 0.363 ms (KDA ``fwd_h`` / ``bwd_dhu``) against FLA's 0.400 / 0.372,
and 0.249 / 0.426 against 0.299 / 0.539 (GDN); where 32 already gives 128
programs, 16 was slower (e.g. 0.892 / 1.116 against 0.840 / 0.849 ms, KDA at
(1, 32768, 32)), and BV 64 for GDN's ``bwd_dhu`` slower than FLA's pick of 32.

The kernels are FLA's own (imported, not copied); only the launch is here.
num_warps and num_stages stay autotuned over FLA's own values, keyed on
FLA's key plus BV and the gate kind.

REWY_HF_STATE_BLOCK_V: ``auto`` (the default, the rule above), ``fla``
(FLA's launch everywhere), or 16, 32 or 64 to force a width (for timing each).
With REWY_HF_DIRECT_LAUNCH=1 (the default; ``direct_launch.py``) FLA's launch at its own
widths is replaced too: the same kernel and arguments, launched here without
FLA's stage function around it.
"""

from __future__ import annotations

import os

import torch
import triton

from . import direct_launch
from .fla_stages import chunk_table

STATE_BLOCK_V_ENV = "REWY_HF_STATE_BLOCK_V"
WIDTHS = (64, 32, 16)
NARROW = 16
# About one program per SM of an H200 (132): below that the sequential walk is the whole stage's time.
MIN_PROGRAMS = 128

# Built at first use (FLA is imported lazily); module-level so that
# rewy_hf.autotune_picks finds them and the bench can forget their picks
# (the bench builds them before its first shape: rewy_hf.bench_ops.load_kernel_modules).
_fwd_h_kernel = None
_bwd_dhu_kernel = None


def sm_count(t: torch.Tensor) -> int:
    """The SMs of ``t``'s GPU; 132 (an H200's) for a tensor off the GPU, so the interpreter
    tests take the launch decisions the H200 takes."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 132


def narrow_block_v(sequences: int, value_heads: int, V: int) -> int | None:
    """16 where FLA's narrowest width (32) leaves fewer than MIN_PROGRAMS programs for
    N = ``sequences`` x HV = ``value_heads`` and 16 gives more; None (FLA's launch) elsewhere."""
    programs_32 = sequences * value_heads * triton.cdiv(V, 32)
    if programs_32 < MIN_PROGRAMS and triton.cdiv(V, NARROW) > triton.cdiv(V, 32):
        return NARROW
    return None


def state_block_v(sequences: int, value_heads: int, V: int) -> int | None:
    """The width REWY_HF_STATE_BLOCK_V asks for at this shape; None: FLA's own launch."""
    mode = os.environ.get(STATE_BLOCK_V_ENV, "auto").strip().lower()
    if mode in ("", "auto"):
        return narrow_block_v(sequences, value_heads, V)
    if mode == "fla":
        return None
    if mode.isdigit() and int(mode) in WIDTHS:
        return int(mode)
    raise ValueError(f"{STATE_BLOCK_V_ENV}={mode!r} is not understood; use auto (the default: BV 16 where FLA's "
                     f"widths leave most SMs idle), fla (FLA's launch everywhere) or one of "
                     f"{', '.join(map(str, WIDTHS))} to force a width")


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


def chunk_count_and_offsets(T: int, cu_seqlens, chunk_size: int, chunk_indices):
    """(chunks per row of the state tensors, first chunk of each sequence): packed
    sequences count their chunks one sequence at a time, as FLA does."""
    NT, _ = chunk_table(T, cu_seqlens, chunk_size, chunk_indices)
    if cu_seqlens is None:
        return NT, None
    from fla.ops.utils import prepare_chunk_offsets

    return NT, prepare_chunk_offsets(cu_seqlens, chunk_size)


def fwd_h(fla_fwd_h, k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, chunk_size=64,
          state_v_first=False, cu_seqlens=None, chunk_indices=None):
    """h, v_new, final state: FLA's ``chunk_gated_delta_rule_fwd_h`` (``fla_fwd_h``), or
    its kernel at the width REWY_HF_STATE_BLOCK_V asks for."""
    B, T, HV, V = u.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    bv = state_block_v(N, HV, V)
    if bv is None and not direct_launch.enabled():
        return fla_fwd_h(k=k, w=w, u=u, g=g, gk=gk, initial_state=initial_state,
                         output_final_state=output_final_state, chunk_size=chunk_size, state_v_first=state_v_first,
                         cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    K = k.shape[-1]
    NT, offsets = chunk_count_and_offsets(T, cu_seqlens, chunk_size, chunk_indices)
    state = (V, K) if state_v_first else (K, V)
    h = k.new_empty(B, NT, HV, *state)
    ht = k.new_zeros(N, HV, *state, dtype=torch.float32) if output_final_state else None
    v_new = torch.empty_like(u)
    kernel, grid, width = _kernel_and_grid(0, bv, N * HV, V)
    direct_launch.launch(
        kernel, grid, k=k, v=u, w=w, v_new=v_new, g=g, gk=gk, h=h, h0=initial_state, ht=ht, cu_seqlens=cu_seqlens,
        chunk_offsets=offsets, T=T, H=k.shape[2], HV=HV, K=K, V=V, BT=chunk_size, **width,
        STATE_V_FIRST=state_v_first)
    return h, v_new, ht


def bwd_dhu(fla_bwd_dhu, q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False,
            cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """dh, dh0, dv2: FLA's ``chunk_gated_delta_rule_bwd_dhu`` (``fla_bwd_dhu``), or its
    kernel at the width REWY_HF_STATE_BLOCK_V asks for."""
    B, T, HV, V = do.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    bv = state_block_v(N, HV, V)
    if bv is None and not direct_launch.enabled():
        return fla_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, g=g, gk=gk, h0=h0, dht=dht, scale=scale,
                           state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                           chunk_indices=chunk_indices)
    K = q.shape[-1]
    NT, offsets = chunk_count_and_offsets(T, cu_seqlens, chunk_size, chunk_indices)
    dh = q.new_empty(B, NT, HV, *((V, K) if state_v_first else (K, V)))
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(dv)
    kernel, grid, width = _kernel_and_grid(1, bv, N * HV, V)
    direct_launch.launch(
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
