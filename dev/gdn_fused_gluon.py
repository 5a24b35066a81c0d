"""A fused GDN backward in Gluon: the reverse state walk and the local Residual WY gradients in one kernel.

One program per (sequence, value head) walks the chunks from last to first, as FlashQLA's fused
backward does. The state gradient dh [K, V] stays on chip for the whole walk (fp32 in registers, a
16-bit copy in shared memory as the operand of its products); dv2, dh and the local value gradient
are never written to memory. Every product is a Hopper warpgroup MMA (second operand in shared
memory). The program is warp specialised into three partitions that hand tiles to each other through
shared memory and mbarriers:

    state (4 warps, 240 registers): dh in registers; S^T, K dh, dV2, dY, dv (out by TMA), and the
        update of dh; it hands dY, beta's share from v, k . q and the carried state's decay term to
        the local partition
    local (4 warps, 240 registers): dq, dk, dg, dbeta from dAqk, dY h^T and the Gram Elimination
        products; it prepares the update's gated operands and reads dh's 16-bit copy for dk; 16-bit dq
        and dk leave by TMA from q's and v_new's tiles once those are read for the last time
    loader (1 warp, 24 registers): the TMA loads of the next chunk's tiles, each as soon as both
        consumers have freed it (one ready and one free barrier per tile)

so the chain's products (state) and the local ones run at once on the SM's tensor cores.

Triton's ``tl`` language could not keep dh on chip
(docs/studies.md, "A fused GDN backward in Triton: does it fit?"). Per chunk, with G the chunk-local
log2 cumulative gate and G_C its last row:

    dV_loc = (Aqk)^T dO                        Aqk: the causal, gated, scaled q-k products
    dV2    = dV_loc + diag(2^(G_C - G)) K dh
    dY     = A^T dV2                           -> dv = beta dY, dbeta
    the local ReWY gradients of kernels/triton_backend/scalar_gate/local_backward.py, whole K
    dh    <- 2^G_C dh + scale (Q diag(2^G))^T dO - (diag(beta 2^G) K)^T dY

The last line is the walk's W^T dV2 with W = A diag(beta 2^G) K, so w is never read.

Inputs are what rewy's backward holds after its state pass (h, v_new per chunk). This version takes
bf16 inputs, K = V = 128, T a multiple of 64, no packing: the shapes of the go / no-go at
(8, 2048, 16). It is not wired into the library.

    # compile for sm_90 on any machine (the GPU's triton first on the path) and print its resources
    PYTHONPATH=/tmp/triton-3.6 python -P $REPO/dev/gdn_fused_gluon.py --resources
    # on an H100 / H200: gradients against the torch reference on synthetic inputs (no autotuning), timed
    python $REPO/dev/gdn_fused_gluon.py --against-reference --time --shapes 8,2048,16 4,4096,16
    # gradients against rewy's split kernels on their own inputs, and both timed
    python $REPO/dev/gdn_fused_gluon.py --check --time --shapes 8,2048,16 4,4096,16
    # with flash-qla installed: its whole backward and its fused kernel alone beside this kernel, same card
    python $REPO/dev/gdn_fused_gluon.py --flash-qla --shapes 8,2048,16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma)

C = 64
# The layouts every partition shares: 16-bit tiles in shared memory (128-byte swizzle), and one warpgroup's
# MMA accumulators for [64, 128] and [64, 64] products with their row and column vectors.
BT = gl.constexpr(C)
SW = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
M = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
MS = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
ROW = gl.constexpr(gl.SliceLayout(1, M.value))
ROW_S = gl.constexpr(gl.SliceLayout(1, MS.value))
COL_S = gl.constexpr(gl.SliceLayout(0, MS.value))
# The block-wide barrier is gl.thread_barrier in triton 3.6 (the GPU machines' version), gl.barrier later.
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# and the TMA load tma.async_copy_global_to_shared, later tma.async_load (same arguments); the TMA store
# tma.async_copy_shared_to_global, later tma.async_store.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


@gluon.jit
def _offsets(row0, R: gl.constexpr, N: gl.constexpr, row_stride, layout: gl.constexpr):
    # The first row enters before the broadcast: offsets of a tile that moves with the loop are formed in
    # it, where loop-invariant [R, N] offset tiles would hold about 200 registers through the walk.
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims((row0 + rows) * row_stride, 1) + gl.expand_dims(cols, 0)


# input tiles, in the order the loader issues them (the order the consumers free them)
TA, TQ, TDO, TH, TK, TV, TVN = (gl.constexpr(i) for i in range(7))
# consumer-to-consumer hand-offs (ready, free pairs)
QX_RDY, QX_FREE, DY_RDY, DY_FREE, DH_RDY, DH_FREE = (gl.constexpr(i) for i in range(6))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _opaque(x):
    # a copy the compiler cannot see through, so nothing computed from it is hoisted out of a loop
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _square_indices():
    # The row and column indices of a chunk's [BT, BT] tiles, formed anew in every chunk: the masks made from
    # them, hoisted out of the loop, would hold about 100 registers through it.
    return _opaque(gl.arange(0, BT, layout=ROW_S)), _opaque(gl.arange(0, BT, layout=COL_S))


@gluon.jit
def _signal(bar):
    # every warp of the partition has stored (or read) and its stores reach the async proxy, then one arrive
    fence_async_shared()
    _barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _load_tile(desc, c0, c1, dst, rdy, free, phase, nbytes: gl.constexpr):
    mbarrier.wait(free, phase)
    fence_async_shared()
    mbarrier.expect(rdy, nbytes)
    _tma_load(desc, [c0, c1], rdy, dst)


@gluon.jit
def _ws_loader(q_desc, k_desc, vn_desc, a_desc, h_desc, do_desc, v_desc, q_s, k_s, do_s, vn_s, a_s, h_s, v_s,
               rdy, free, T, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    i_nh = gl.program_id(0)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    NT = T // BT
    row0 = i_n * T
    h_row0 = (i_n * NT * HV + i_hv) * K
    for j in range(NT):
        i_t = NT - 1 - j
        r = row0 + i_t * BT
        ph = (j & 1) ^ 1
        _load_tile(a_desc, r, i_hv * BT, a_s, rdy.index(TA), free.index(TA), ph, 2 * BT * BT)
        _load_tile(q_desc, r, i_h * K, q_s, rdy.index(TQ), free.index(TQ), ph, 2 * BT * K)
        _load_tile(do_desc, r, i_hv * V, do_s, rdy.index(TDO), free.index(TDO), ph, 2 * BT * V)
        _load_tile(h_desc, h_row0 + i_t * (HV * K), 0, h_s, rdy.index(TH), free.index(TH), ph, 2 * K * V)
        _load_tile(k_desc, r, i_h * K, k_s, rdy.index(TK), free.index(TK), ph, 2 * BT * K)
        _load_tile(v_desc, r, i_hv * V, v_s, rdy.index(TV), free.index(TV), ph, 2 * BT * V)
        _load_tile(vn_desc, r, i_hv * V, vn_s, rdy.index(TVN), free.index(TVN), ph, 2 * BT * V)


@gluon.jit
def _ws_state(q_s, k_s, do_s, a_s, h_s, v_s, st_s, dy_s, qg_s, x3_s, dh_s, dbp_s, dgc_s, kqd_s, rdy, free, hand,
              dv_desc, g, beta, dht, dh0, scale, T,
              H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
              USE_DHT: gl.constexpr, USE_DH0: gl.constexpr):
    # One warpgroup: dh [K, V] in fp32 registers, the chain dh -> K dh -> dV2 -> dY -> dh.
    f32: gl.constexpr = gl.float32
    lp: gl.constexpr = gl.bfloat16

    i_nh = gl.program_id(0)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    NT = T // BT
    row0 = i_n * T
    bos = i_n.to(gl.int64) * T
    g += bos * HV + i_hv
    beta += bos * HV + i_hv
    rows = gl.arange(0, BT, layout=ROW)

    if USE_DHT:
        b_dh = gl.load(dht + i_nh.to(gl.int64) * K * V + _offsets(0, K, V, V, M))
    else:
        b_dh = gl.zeros([K, V], f32, M)
    dh_s.store(b_dh.to(lp))
    _signal(hand.index(DH_RDY))

    for j in range(NT):
        i_t = NT - 1 - j
        tok = i_t.to(gl.int64) * BT
        ph = j & 1
        g_w = gl.load(g + (tok + rows) * HV)
        g_last = gl.load(g + (tok + BT - 1) * HV)
        b_w = gl.load(beta + (tok + rows) * HV).to(f32)
        b_rev = gl.exp2(g_last - g_w)

        # S^T[j, i] = scale k_j . q_i 2^(G_i - G_j), i >= j (masked before exp2), and k . q for the local side
        rows_s, cols_s = _square_indices()
        r_s = gl.expand_dims(rows_s, 1)
        c_s = gl.expand_dims(cols_s, 0)
        g_r = gl.load(g + (tok + rows_s) * HV)
        g_c = gl.load(g + (tok + cols_s) * HV)
        mbarrier.wait(rdy.index(TK), ph)
        mbarrier.wait(rdy.index(TQ), ph)
        b_kq = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([BT, BT], f32, MS), use_acc=False)
        b_st = b_kq * gl.exp2(gl.where(c_s >= r_s, gl.expand_dims(g_c, 0) - gl.expand_dims(g_r, 1), float("-inf")))
        # st_s held the local partition's P and dy_s its dY of the previous chunk: wait until it is done
        mbarrier.wait(hand.index(DY_FREE), ph ^ 1)
        kqd_s.store(gl.sum(gl.where(c_s == r_s, b_kq, 0.0), axis=1))
        st_s.store((b_st * scale).to(lp))

        # dV2 = 2^(G_C - G) K dh + S^T dO
        b_dv2 = warpgroup_mma(k_s, dh_s, gl.zeros([BT, V], f32, M), use_acc=False)
        _signal(free.index(TQ))         # its fence and barrier also publish st_s to the MMA below
        _signal(free.index(TK))
        mbarrier.wait(rdy.index(TDO), ph)
        b_dv2 = warpgroup_mma(st_s, do_s, b_dv2 * gl.expand_dims(b_rev, 1))
        # dV2 is staged in dy_s, which then takes dY
        dy_s.store(b_dv2.to(lp))
        fence_async_shared()
        _barrier()

        # dY = A^T dV2 -> dv, beta's share from v; dv leaves by TMA from v's tile
        mbarrier.wait(rdy.index(TA), ph)
        b_dy = warpgroup_mma(a_s.permute((1, 0)), dy_s, gl.zeros([BT, V], f32, M), use_acc=False)
        _signal(free.index(TA))         # also: every warp's MMA has read dV2 before dY overwrites it
        dy_s.store(b_dy.to(lp))
        mbarrier.wait(rdy.index(TV), ph)
        dbp_s.store(gl.sum(b_dy * v_s.load(M).to(f32), axis=1))
        _barrier()
        v_s.store((b_dy * gl.expand_dims(b_w, 1)).to(lp))
        fence_async_shared()
        _barrier()
        _tma_store(dv_desc, [row0 + i_t * BT, i_hv * V], v_s)

        # the decay term of the carried state: sum(h * dh), dh the gradient leaving this chunk
        mbarrier.wait(rdy.index(TH), ph)
        b_dgc = gl.sum(gl.sum(h_s.load(M).to(f32) * b_dh, axis=1), axis=0)
        _signal(free.index(TH))
        dgc_s.store(gl.zeros([BT], f32, ROW) + b_dgc * gl.exp2(g_last))
        _signal(hand.index(DY_RDY))

        # dh <- 2^G_C dh + (scale Q diag(2^G))^T dO + (-diag(beta 2^G) K)^T dY
        mbarrier.wait(hand.index(QX_RDY), ph)
        b_dh = warpgroup_mma(qg_s.permute((1, 0)), do_s, b_dh * gl.exp2(g_last))
        _signal(free.index(TDO))
        b_dh = warpgroup_mma(x3_s.permute((1, 0)), dy_s, b_dh)
        _signal(hand.index(QX_FREE))
        mbarrier.wait(hand.index(DH_FREE), ph)
        dh_s.store(b_dh.to(lp))
        _signal(hand.index(DH_RDY))
        tma.store_wait(0)
        _signal(free.index(TV))

    if USE_DH0:
        gl.store(dh0 + _offsets(i_nh.to(gl.int64) * K, K, V, V, M), b_dh)


@gluon.jit
def _ws_local(q_s, k_s, do_s, vn_s, h_s, st_s, p_s, dy_s, qg_s, x3_s, dh_s, dbp_s, dgc_s, kqd_s, rdy, free, hand,
              g, beta, dq, dk, dq_desc, dk_desc, dg, db, scale, T,
              H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    # One warpgroup: the local gradients of each chunk, the state's only through dY and dh_s. Where dq and dk
    # are 16-bit (H == HV) they leave by TMA from the tiles of q and v_new, once those are read for the last
    # time; fp32 (value heads sharing a key head) they leave by per-thread stores.
    f32: gl.constexpr = gl.float32
    lp: gl.constexpr = gl.bfloat16
    VEC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    i_nh = gl.program_id(0)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    NT = T // BT
    bos = i_n.to(gl.int64) * T
    dq += (bos * HV + i_hv) * K
    dk += (bos * HV + i_hv) * K
    g += bos * HV + i_hv
    beta += bos * HV + i_hv
    dg += bos * HV + i_hv
    db += bos * HV + i_hv
    rows_w = gl.arange(0, BT, layout=ROW)
    rows_v = gl.arange(0, BT, layout=VEC)
    row0 = i_n * T

    for j in range(NT):
        i_t = NT - 1 - j
        tok = i_t.to(gl.int64) * BT
        ph = j & 1
        rows_s, cols_s = _square_indices()
        r_s = gl.expand_dims(rows_s, 1)
        c_s = gl.expand_dims(cols_s, 0)
        below = c_s < r_s
        g_w = gl.load(g + (tok + rows_w) * HV)
        g_r = gl.load(g + (tok + rows_s) * HV)
        g_c = gl.load(g + (tok + cols_s) * HV)
        g_last = gl.load(g + (tok + BT - 1) * HV)
        b_w = gl.load(beta + (tok + rows_w) * HV).to(f32)
        b_r = gl.load(beta + (tok + rows_s) * HV).to(f32)
        b_eg = gl.exp2(g_w)

        # the update's gated operands
        mbarrier.wait(rdy.index(TK), ph)
        mbarrier.wait(rdy.index(TQ), ph)
        mbarrier.wait(hand.index(QX_FREE), ph ^ 1)
        qg_s.store((q_s.load(M).to(f32) * gl.expand_dims(scale * b_eg, 1)).to(lp))
        x3_s.store((k_s.load(M).to(f32) * gl.expand_dims(-b_w * b_eg, 1)).to(lp))
        _signal(hand.index(QX_RDY))

        # Output side: P2 = dAqk * Gamma -> dq and q's share of dk
        mbarrier.wait(rdy.index(TDO), ph)
        mbarrier.wait(rdy.index(TVN), ph)
        b_daqk = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([BT, BT], f32, MS), use_acc=False)
        gam = gl.exp2(gl.where(below, gl.expand_dims(g_r, 1) - gl.expand_dims(g_c, 0), float("-inf")))
        b_diag = gl.convert_layout(scale * gl.sum(gl.where(c_s == r_s, b_daqk, 0.0), axis=1), ROW)
        p_s.store((b_daqk * gam * scale).to(lp))
        mbarrier.wait(rdy.index(TH), ph)
        b_dq = warpgroup_mma(do_s, h_s.permute((1, 0)), gl.zeros([BT, K], f32, M), use_acc=False)
        _signal(free.index(TDO))          # its fence and barrier also publish p_s to the MMA below
        b_dq = warpgroup_mma(p_s, k_s, b_dq * gl.expand_dims(scale * b_eg, 1))
        b_dG = gl.sum(q_s.load(M).to(f32) * b_dq, axis=1)
        b_dq += gl.expand_dims(b_diag, 1) * k_s.load(M).to(f32)
        b_dq = b_dq.to(dq.dtype.element_ty)
        if H != HV:
            gl.store(dq + _offsets(i_t * BT, BT, K, HV * K, M), b_dq)
        # the accumulator starts at diag * q; k . (diag q) = diag (k . q) is taken out of dG below
        b_dk = warpgroup_mma(p_s.permute((1, 0)), q_s, gl.expand_dims(b_diag, 1) * q_s.load(M).to(f32))

        # Key side: dX = -dY h^T, P = -(dY Vn^T) * Gamma, Gram Elimination as the local kernel
        mbarrier.wait(hand.index(DY_RDY), ph)
        if H == HV:
            # q's tile is read for the last time (the state partition read it before it made dY): dq leaves from it
            q_s.store(b_dq)
            fence_async_shared()
            _barrier()
            _tma_store(dq_desc, [row0 + i_t * BT, i_hv * K], q_s)
        b_dyvn = warpgroup_mma(dy_s, vn_s.permute((1, 0)), gl.zeros([BT, BT], f32, MS), use_acc=False)
        # Gamma again, written so that it is not kept from above through the output side
        b_pm = gl.where(below, -b_dyvn * gl.exp2(gl.expand_dims(g_r, 1) - gl.expand_dims(g_c, 0)), 0.0)
        # st_s is free: the chain read it before it produced dY
        st_s.store(b_pm.to(lp))
        p_s.store((b_pm * gl.expand_dims(b_r, 1)).to(lp))
        fence_async_shared()
        _barrier()
        b_da = warpgroup_mma(dy_s, h_s.permute((1, 0)), gl.zeros([BT, K], f32, M), use_acc=False)
        _signal(free.index(TH))
        tma.store_wait(0)
        _signal(free.index(TQ))
        b_da = warpgroup_mma(st_s, k_s, -b_da * gl.expand_dims(b_eg, 1))
        b_dk = warpgroup_mma(p_s.permute((1, 0)), k_s, b_dk)
        b_k = k_s.load(M).to(f32)
        _signal(free.index(TK))         # the next chunk's k loads while the key-state term below runs
        b_dbeta = dbp_s.load(ROW) + gl.sum(b_da * b_k, axis=1)
        b_dgc = dgc_s.load(VEC)
        b_kqd = kqd_s.load(ROW)
        _signal(hand.index(DY_FREE))
        gl.store(db + (tok + rows_w) * HV, b_dbeta)
        b_dG += gl.sum(b_k * (gl.expand_dims(b_w, 1) * b_da - b_dk), axis=1) + b_diag * b_kqd
        b_dk += b_da * gl.expand_dims(b_w, 1)

        # the key-state term: 2^(G_C - G) Vn dh^T, and kc = k . that
        mbarrier.wait(hand.index(DH_RDY), ph)
        b_ks = warpgroup_mma(vn_s, dh_s.permute((1, 0)), gl.zeros([BT, K], f32, M), use_acc=False)
        _signal(hand.index(DH_FREE))
        b_ks = b_ks * gl.expand_dims(gl.exp2(g_last - g_w), 1)
        b_kc = gl.sum(b_ks * b_k, axis=1)
        b_dk += b_ks
        if H == HV:
            # v_new's tile is read for the last time: dk leaves from it
            vn_s.store(b_dk.to(dk.dtype.element_ty))
            fence_async_shared()
            _barrier()
            _tma_store(dk_desc, [row0 + i_t * BT, i_hv * K], vn_s)
        else:
            gl.store(dk + _offsets(i_t * BT, BT, K, HV * K, M), b_dk.to(dk.dtype.element_ty))

        # dg = (the suffix sum of dG) + (the prefix sum of kc before the row) + the carried state's term
        b_kc = gl.convert_layout(b_kc, VEC)
        b_before = gl.associative_scan(b_kc, 0, _add) - b_kc
        b_after = gl.associative_scan(gl.convert_layout(b_dG, VEC), 0, _add, reverse=True)
        gl.store(dg + (tok + rows_v) * HV, b_after + b_before + b_dgc)
        tma.store_wait(0)
        _signal(free.index(TVN))


@gluon.jit
def gdn_fused_bwd_kernel(q_desc, k_desc, v_desc, vn_desc, g, beta, a_desc, h_desc, do_desc, dht, dq, dk,
                            dq_desc, dk_desc, dv_desc, dg, db, dh0, scale, T,
                            H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                            USE_DHT: gl.constexpr, USE_DH0: gl.constexpr):
    lp: gl.constexpr = gl.bfloat16
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_s = gl.allocate_shared_memory(lp, [BT, K], SW)
    k_s = gl.allocate_shared_memory(lp, [BT, K], SW)
    do_s = gl.allocate_shared_memory(lp, [BT, V], SW)
    vn_s = gl.allocate_shared_memory(lp, [BT, V], SW)
    a_s = gl.allocate_shared_memory(lp, [BT, BT], SW)
    h_s = gl.allocate_shared_memory(lp, [K, V], SW)
    dh_s = gl.allocate_shared_memory(lp, [K, V], SW)
    st_s = gl.allocate_shared_memory(lp, [BT, BT], SW)
    p_s = gl.allocate_shared_memory(lp, [BT, BT], SW)
    v_s = gl.allocate_shared_memory(lp, [BT, V], SW)
    dy_s = gl.allocate_shared_memory(lp, [BT, V], SW)
    qg_s = gl.allocate_shared_memory(lp, [BT, K], SW)
    x3_s = gl.allocate_shared_memory(lp, [BT, K], SW)
    dbp_s = gl.allocate_shared_memory(gl.float32, [BT], PLAIN)
    dgc_s = gl.allocate_shared_memory(gl.float32, [BT], PLAIN)
    kqd_s = gl.allocate_shared_memory(gl.float32, [BT], PLAIN)
    rdy = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(7):
        mbarrier.init(rdy.index(i), count=1)
    # how many partitions read each input tile: a, q, do, h, k, v, vn
    mbarrier.init(free.index(TA), count=1)
    mbarrier.init(free.index(TQ), count=2)
    mbarrier.init(free.index(TDO), count=2)
    mbarrier.init(free.index(TH), count=2)
    mbarrier.init(free.index(TK), count=2)
    mbarrier.init(free.index(TVN), count=1)
    mbarrier.init(free.index(TV), count=1)
    for i in gl.static_range(6):
        mbarrier.init(hand.index(i), count=1)

    gl.warp_specialize([
        (_ws_state, (q_s, k_s, do_s, a_s, h_s, v_s, st_s, dy_s, qg_s, x3_s, dh_s, dbp_s, dgc_s, kqd_s, rdy, free,
                     hand, dv_desc, g, beta, dht, dh0, scale, T, H, HV, K, V, USE_DHT, USE_DH0)),
        (_ws_local, (q_s, k_s, do_s, vn_s, h_s, st_s, p_s, dy_s, qg_s, x3_s, dh_s, dbp_s, dgc_s, kqd_s, rdy, free, hand,
                     g, beta, dq, dk, dq_desc, dk_desc, dg, db, scale, T, H, HV, K, V)),
        (_ws_loader, (q_desc, k_desc, vn_desc, a_desc, h_desc, do_desc, v_desc, q_s, k_s, do_s, vn_s, a_s, h_s,
                      v_s, rdy, free, T, H, HV, K, V)),
    ], [4, 1], [240, 24])


def shared_layout():
    """The 128-byte swizzled layout of every 16-bit tile (rows of 64 or 128 elements)."""
    return SW.value


# A 4-warp state partition (the default one), a 4-warp local partition and a 1-warp loader: registers per
# thread 240 / 240 / 24 out of MAXNREG x 12 warps (the loader's warpgroup counts whole).
WARPS, MAXNREG = 4, 168


def fused_backward(q, k, v, v_new, g, beta, A, h, do, dht=None, h0=None, scale: float = 1.0):
    """(dq, dk per value head, dv, dg share, db, dh0) from the inputs of rewy's local kernel. dq and dk come in
    q's dtype where each value head has its own key head and in fp32 where value heads share one (they are
    summed over the group after), as the split local kernel writes them."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if (K, V) != (128, 128) or T % C or q.dtype != torch.bfloat16:
        raise ValueError(f"this kernel takes bf16, K = V = 128 and T a multiple of {C}: got {q.dtype}, "
                         f"K = {K}, V = {V}, T = {T}")
    dq = torch.empty(B, T, HV, K, device=q.device, dtype=q.dtype if HV == H else torch.float32)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(v)
    dg = torch.empty(B, T, HV, device=q.device, dtype=torch.float32)
    db = torch.empty_like(dg)
    dh0 = torch.empty(B, HV, K, V, device=q.device, dtype=torch.float32) if h0 is not None else None
    lay = shared_layout()
    NT = T // C

    def desc(x, rows, block):
        return TensorDescriptor.from_tensor(x.reshape(rows, -1), block, lay)

    # fp32 dq and dk (value heads sharing a key head) are stored per thread; the descriptors are then unused
    out_descs = [desc(x if HV == H else dv, B * T, [C, K]) for x in (dq, dk)]

    gdn_fused_bwd_kernel[(B * HV,)](
        desc(q, B * T, [C, K]), desc(k, B * T, [C, K]), desc(v, B * T, [C, V]), desc(v_new, B * T, [C, V]), g, beta,
        desc(A, B * T, [C, C]), desc(h, B * NT * HV * K, [K, V]), desc(do, B * T, [C, V]),
        dht if dht is not None else dg, dq, dk, *out_descs, desc(dv, B * T, [C, V]), dg, db,
        dh0 if dh0 is not None else dg, scale, T, H=H, HV=HV, K=K, V=V, USE_DHT=dht is not None,
        USE_DH0=dh0 is not None, num_warps=WARPS, maxnreg=MAXNREG)
    return dq, dk, dv, dg, db, dh0


def compile_sm90(H: int = 16, HV: int = 16, arch: int = 90):
    """The kernel compiled for sm_<arch> without a GPU (bf16 inputs, and bf16 dq and dk where H == HV; fp32
    gate and the other outputs)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gdn_fused_bwd_kernel
    options = dict(num_warps=WARPS, maxnreg=MAXNREG)
    bf16 = {"beta", "dq", "dk"} if H == HV else {"beta"}
    blocks = {"q_desc": (C, 128), "k_desc": (C, 128), "vn_desc": (C, 128), "do_desc": (C, 128), "a_desc": (C, C),
              "h_desc": (128, 128), "v_desc": (C, 128), "dv_desc": (C, 128), "dq_desc": (C, 128),
              "dk_desc": (C, 128)}
    const = dict(H=H, HV=HV, K=128, V=128, USE_DHT=False, USE_DH0=False)
    sig = {}
    for n in fn.arg_names:
        sig[n] = "constexpr" if n in const else "fp32" if n == "scale" else "i32" if n == "T" else \
            f"tensordesc<bf16[{blocks[n][0]}, {blocks[n][1]}],{shared_layout()!r}>" if n in blocks else \
            "*bf16" if n in bf16 else "*fp32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in const.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _resources() -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_registers import opcode_counts, resource_usage

    compiled = compile_sm90()
    row = {"kernel": "gdn_fused_bwd_kernel (Gluon)", "triton": triton.__version__,
           "warps": compiled.metadata.num_warps, **resource_usage(compiled)}
    ops = opcode_counts(compiled)
    row["instructions"] = sum(ops.values())
    row["wgmma"] = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    return row


def op_inputs(B, T, H, seed=0):
    """A GDN op's inputs at one shape (bf16, K = V = 128, l2-normalised q and k, mild gates), leaves that take
    gradients, and the output gradient: what both rewy's and FlashQLA's backward are run on."""
    import torch

    torch.manual_seed(seed)
    dev = "cuda"
    K = V = 128
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16().requires_grad_()
    v = torch.randn(B, T, H, V, device=dev).bfloat16().requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 4).requires_grad_()
    beta = torch.rand(B, T, H, device=dev).sigmoid().bfloat16().requires_grad_()
    do = torch.randn(B, T, H, V, device=dev).bfloat16()
    return q, k, v, g, beta, do


def split_backward_inputs(B, T, H, seed=0):
    """Inputs and outputs of rewy's split backward (full policy) at one shape, captured at its local kernel."""
    import rewy_hf
    from rewy_hf.kernels.triton_backend.scalar_gate import stages

    q, k, v, g, beta, do = op_inputs(B, T, H, seed)
    seen = {}
    original = stages.ScalarGate.local_backward

    def capture(t, do_, dh, dv2, call, pk):
        out = original(t, do_, dh, dv2, call, pk)
        seen.update(w=t.w, q=t.q, k=t.k, v=t.v, v_new=t.v_new, g=t.g2, beta=t.beta, A=t.A, h=t.h, do=do_,
                    scale=call.scale, out=out)
        return out

    stages.ScalarGate.local_backward = staticmethod(capture)
    try:
        o, _ = rewy_hf.chunk_gated_delta_rule(q, k, v, g, beta, backend="triton", policy="full")
        o.backward(do)
    finally:
        stages.ScalarGate.local_backward = staticmethod(original)
    return seen


def kernel_args(s: dict) -> tuple:
    """The kernel's (and the reference's) positional inputs from a dict of synthetic or captured inputs."""
    return tuple(s[n] for n in ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do"))


def synthetic_inputs(B, T, H, seed=0, device="cuda", HV=None):
    """Inputs shaped and scaled as the fused kernels' (bf16, chunk-local log2 gate cumsum, a lower-triangular A,
    per-chunk states), made directly: checking the kernel against the reference needs no forward and no
    autotuning. With HV, q and k have H heads and everything else HV (value heads sharing a key head)."""
    import torch

    g_ = torch.Generator(device=device).manual_seed(seed)
    K = V = 128
    NT = T // C
    Hk, H = H, HV or H

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g_) * scale).bfloat16()

    q = torch.nn.functional.normalize(rnd(B, T, Hk, K).float(), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rnd(B, T, Hk, K).float(), dim=-1).bfloat16()
    gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device, generator=g_) + 4) * 1.4426950408889634
    g = gate.view(B, NT, C, H).cumsum(2).view(B, T, H).contiguous()
    tri = torch.tril(torch.randn(B, NT, H, C, C, device=device, generator=g_) * 0.1, -1)
    A = (tri + torch.eye(C, device=device)).permute(0, 1, 3, 2, 4).reshape(B, T, H, C)
    return dict(q=q, k=k, v=rnd(B, T, H, V), v_new=rnd(B, T, H, V), g=g,
                beta=torch.rand(B, T, H, device=device, generator=g_).bfloat16(), A=A.bfloat16().contiguous(),
                h=rnd(B, NT, H, K, V, scale=0.3), do=rnd(B, T, H, V), scale=K ** -0.5)


def reference_backward(q, k, v, v_new, g, beta, A, h, do, scale: float, dht=None, dtype=None):
    """The kernel's outputs (dq, dk, dv, dg, db, dh0) computed chunk by chunk in torch (float32 unless
    ``dtype``), as the module docstring writes them; q and k may have fewer heads than v (each value head reads
    its group's), and dq, dk come per value head as the kernel writes them."""
    import torch

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = T // C
    dtype = dtype or torch.float32
    q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    f = lambda x: x.to(dtype).transpose(1, 2).reshape(B, HV, NT, C, *x.shape[3:])  # noqa: E731  [B, HV, NT, C, ...]
    q_, k_, v_, vn, do_ = f(q), f(k), f(v), f(v_new), f(do)
    g_, b_, A_ = f(g), f(beta), f(A)
    h_ = h.to(dtype).transpose(1, 2)                                          # [B, HV, NT, K, V]
    i = torch.arange(C, device=q.device)
    after, below = i[None, :] >= i[:, None], i[None, :] < i[:, None]          # [row, col]
    dh = torch.zeros(B, HV, K, V, device=q.device, dtype=dtype) if dht is None else dht.to(dtype)
    outs = {n: [] for n in ("dq", "dk", "dv", "dg", "db")}
    mm = torch.matmul
    for t in reversed(range(NT)):
        Q, Kc, Vc, Vn, dO, G, b, Ac, Hc = (x[:, :, t] for x in (q_, k_, v_, vn, do_, g_, b_, A_, h_))
        Gc = G[..., -1:]
        eg, rev = torch.exp2(G), torch.exp2(Gc - G)
        decay = torch.exp2(G[..., :, None] - G[..., None, :])                # 2^(G_row - G_col)
        St = torch.where(after, mm(Kc, Q.transpose(-1, -2)) * decay.transpose(-1, -2), 0) * scale
        dY = mm(Ac.transpose(-1, -2), mm(St, dO) + rev[..., None] * mm(Kc, dh))
        daqk = mm(dO, Vn.transpose(-1, -2))
        diag = scale * torch.diagonal(daqk, dim1=-2, dim2=-1)
        P2 = torch.where(below, daqk * decay, 0) * scale
        dq = mm(dO, Hc.transpose(-1, -2)) * (scale * eg)[..., None] + mm(P2, Kc)
        dG = (Q * dq).sum(-1)
        dq = dq + diag[..., None] * Kc
        ks = rev[..., None] * mm(Vn, dh.transpose(-1, -2))
        Pm = -torch.where(below, mm(dY, Vn.transpose(-1, -2)) * decay, 0)
        da = -mm(dY, Hc.transpose(-1, -2)) * eg[..., None] + mm(Pm, Kc)
        dk = ks + mm(P2.transpose(-1, -2), Q) + mm((Pm * b[..., None]).transpose(-1, -2), Kc)
        kc = (Kc * ks).sum(-1)
        dG = dG + (Kc * (b[..., None] * da - dk)).sum(-1) + kc
        dgc = (Hc * dh).sum((-1, -2))[..., None] * torch.exp2(Gc)
        outs["dq"].append(dq)
        outs["dk"].append(dk + diag[..., None] * Q + da * b[..., None])
        outs["dv"].append(dY * b[..., None])
        outs["db"].append((dY * Vc).sum(-1) + (da * Kc).sum(-1))
        outs["dg"].append(dG.flip(-1).cumsum(-1).flip(-1) + kc.cumsum(-1) - kc + dgc)
        dh = Gc.exp2()[..., None] * dh + mm((Q * (scale * eg)[..., None]).transpose(-1, -2), dO) \
            + mm((Kc * (-b * eg)[..., None]).transpose(-1, -2), dY)
    # chunks were appended last first; back to [B, T, HV, ...]; then dh0, the gradient leaving the first chunk
    return tuple(torch.stack(outs[n][::-1], 2).reshape(B, HV, T, *outs[n][0].shape[3:]).transpose(1, 2)
                 for n in ("dq", "dk", "dv", "dg", "db")) + (dh,)


def _errors(got, ref) -> dict:
    """Relative error and finiteness of each gradient against another computation of it."""
    import torch

    row = {}
    for name, a, b in zip(("dq", "dk", "dv", "dg", "db"), got, ref):
        a, b = a.float(), b.float()
        row[f"err_{name}"] = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        row[f"finite_{name}"] = bool(torch.isfinite(a).all())
    return row


def _against_reference(shapes, time: bool) -> list[dict]:
    import torch
    from triton.testing import do_bench

    rows = []
    for B, T, H in shapes:
        s = synthetic_inputs(B, T, H)
        args = kernel_args(s)
        ref = reference_backward(*args, scale=s["scale"])
        got = fused_backward(*args, scale=s["scale"])
        torch.cuda.synchronize()
        row = {"B": B, "T": T, "H": H, "inputs": "synthetic", "reference": "float32 torch", **_errors(got, ref)}
        if time:
            row["fused_ms"] = do_bench(lambda: fused_backward(*args, scale=s["scale"]), return_mode="median")
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _check_and_time(shapes, check: bool, time: bool) -> list[dict]:
    import torch
    from triton.testing import do_bench
    from rewy_hf.kernels.triton_backend.scalar_gate import reverse_walk
    from rewy_hf.kernels.triton_backend.scalar_gate.local_backward import rewy_gdn_bwd_local
    from rewy_hf.kernels.triton_backend import fla_stages

    rows = []
    for B, T, H in shapes:
        s = split_backward_inputs(B, T, H)
        args = kernel_args(s)
        row = {"B": B, "T": T, "H": H}
        if check:
            got = fused_backward(*args, scale=s["scale"])
            torch.cuda.synchronize()
            row.update(_errors(got, s["out"]))
        if time:
            row["fused_ms"] = do_bench(lambda: fused_backward(*args, scale=s["scale"]), return_mode="median")

            def split():
                dvl = fla_stages.dv_local(q=s["q"], k=s["k"], do=s["do"], g=s["g"], scale=s["scale"], chunk_size=64)
                dh, _, dv2 = reverse_walk.reverse_walk(s["q"], s["k"], s["w"], s["do"], dvl,
                                                       g=s["g"], scale=s["scale"])
                rewy_gdn_bwd_local(s["q"], s["k"], s["v"], s["v_new"], s["g"], s["beta"], s["A"], s["h"], dh,
                                   s["do"], dv2, scale=s["scale"])
            row["split_ms"] = do_bench(split, return_mode="median")
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _flash_qla(shapes) -> list[dict]:
    """FlashQLA beside this kernel on the same card and in the same process: its whole backward (through
    autograd, the forward graph built outside the timing), and its fused backward kernel alone on the arguments
    its backward hands that kernel; this kernel on synthetic inputs of the shape. Timing only: the two kernels
    take different inputs (FlashQLA recomputes v_new in its fused kernel and reads v; this one reads v_new)."""
    import torch
    from triton.testing import do_bench
    import flash_qla
    from flash_qla.ops.gated_delta_rule import chunk as qla_chunk

    rows = []
    for B, T, H in shapes:
        q, k, v, g, beta, do = op_inputs(B, T, H)
        seen = {}
        original = qla_chunk.fused_gdr_bwd

        def capture(**kw):
            seen.update(kw)
            return original(**kw)

        qla_chunk.fused_gdr_bwd = capture
        try:
            o, _ = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta)
            grads = torch.autograd.grad(o, (q, k, v, g, beta), do, retain_graph=True)
        finally:
            qla_chunk.fused_gdr_bwd = original
        torch.cuda.synchronize()
        row = {"B": B, "T": T, "H": H, "flash_qla": flash_qla.__version__,
               "flash_qla_finite": all(bool(torch.isfinite(x).all()) for x in grads)}
        row["flash_qla_backward_ms"] = do_bench(
            lambda: torch.autograd.grad(o, (q, k, v, g, beta), do, retain_graph=True), return_mode="median")
        row["flash_qla_fused_ms"] = do_bench(lambda: original(**seen), return_mode="median")
        s = synthetic_inputs(B, T, H)
        args = kernel_args(s)
        row["fused_ms"] = do_bench(lambda: fused_backward(*args, scale=s["scale"]), return_mode="median")
        row["speedup_vs_flash_qla_fused"] = row["flash_qla_fused_ms"] / row["fused_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del o, grads, seen
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--resources", action="store_true", help="compile for sm_90 here and print its resources")
    p.add_argument("--check", action="store_true", help="GPU: gradients against rewy's split kernels")
    p.add_argument("--time", action="store_true", help="GPU: the fused kernel against the split kernels it replaces")
    p.add_argument("--shapes", nargs="+", default=["8,2048,16"], metavar="B,T,H")
    p.add_argument("--against-reference", action="store_true",
                   help="GPU: gradients against a float32 torch reference on synthetic inputs (no forward, no "
                        "autotuning); with --time, the kernel timed")
    p.add_argument("--flash-qla", action="store_true",
                   help="GPU, with flash-qla installed: its whole backward and its fused kernel alone timed beside "
                        "this kernel (timing only)")
    p.add_argument("--json", default=None, metavar="OUT.json")
    a = p.parse_args()
    out = {}
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes]
    if a.resources:
        out["resources"] = _resources()
        print(json.dumps(out["resources"]))
    if a.against_reference:
        out["against_reference"] = _against_reference(shapes, a.time)
    elif a.check or a.time:
        out["rows"] = _check_and_time(shapes, a.check, a.time)
    if a.flash_qla:
        out["flash_qla"] = _flash_qla(shapes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
