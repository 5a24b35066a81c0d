"""The triton backend of GDN and DeltaNet on CUDA (GPU only).

BF16 inputs; the reference is rewy's torch backend on the same values in
float32. For DeltaNet FLA's own backward runs too, and ours must be no less
accurate (within 10 %); FLA's GDN backward refuses to run on Hopper with
Triton < 3.7.1, so GDN is held to the BF16-level bound alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2


def _inputs(op, B, T, H, HV, K, V, h0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, HV, V)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen)
    args = [q.bfloat16(), k.bfloat16(), v.bfloat16()]
    args += [beta] if op == "delta_rule" else [F.logsigmoid(r(B, T, HV)), beta]
    kw = dict(output_final_state=True)
    if h0:
        kw["initial_state"] = 0.3 * r(B, HV, K, V)
    return args, kw


def _grads(fn, args, kw, do, dht):
    leaves = [a.detach().requires_grad_() for a in args]
    kw = {k: (v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k, v in kw.items()}
    o, ht = fn(*leaves, **kw)
    extra = [kw["initial_state"]] if "initial_state" in kw else []
    return [o, ht] + list(torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves + extra))


@pytest.mark.parametrize("dx_from_dy", ["0", "1"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op,shape", [
    ("gdn", (2, 300, 2, 4, 128, 128)),       # GVA, ragged T
    ("gdn", (1, 1024, 4, 4, 64, 128)),
    ("delta_rule", (2, 300, 4, 4, 128, 64)),
])
def test_triton_matches_fp32_reference(op, shape, policy, dx_from_dy, monkeypatch):
    """Both forms of the local kernel's dX: -dY h^T in the loop (the default) and A^T dW after it
    (REWY_HF_GDN_DX_FROM_DY=0)."""
    monkeypatch.setenv("REWY_HF_GDN_DX_FROM_DY", dx_from_dy)
    B, T, H, HV, K, V = shape
    args, kw = _inputs(op, B, T, H, HV, K, V, h0=True)
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(B, T, HV, V, device="cuda")
    dht = torch.randn(B, HV, K, V, device="cuda")
    ref = _grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs
    if op == "delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule as fla_delta

        theirs = _grads(fla_delta, args, kw, do, dht)
        fla_errs = [rel_err(x, r) for x, r in zip(theirs, ref)]
        assert all(e <= 1.1 * f + 1e-3 for e, f in zip(errs, fla_errs)), (errs, fla_errs)


def test_triton_l2norm_and_fused_gate():
    B, T, H, K, V = 2, 200, 2, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    args = [r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16(), r(B, T, H, V).bfloat16(), r(B, T, H), r(B, T, H)]
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=r(H), dt_bias=r(H),
              use_beta_sigmoid_in_kernel=True, output_final_state=True)
    do, dht = torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")
    f = rewy_hf.chunk_gated_delta_rule
    ref = _grads(lambda *a, **k: f(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: f(*a, backend="triton", **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs


@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_triton_packed_sequences(op, policy):
    """cu_seqlens (three sequences packed in one row, an initial state each) against the
    torch backend in float32, and each sequence against its own unpacked run."""
    lengths = [200, 64, 333]
    T, H, K, V = sum(lengths), 2, 128, 64
    args, kw = _inputs(op, 1, T, H, H, K, V, h0=False, seed=2)
    kw["initial_state"] = 0.3 * torch.randn(len(lengths), H, K, V, device="cuda")
    kw["cu_seqlens"] = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(1, T, H, V, device="cuda")
    dht = torch.randn(len(lengths), H, K, V, device="cuda")
    ref = _grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_direct_launch_changes_nothing_computed(monkeypatch, policy, packed):
    """REWY_HF_DIRECT_LAUNCH=1 launches the same kernels with the same picks as the autotuners
    would (kernels/direct_launch.py): every output and gradient equal bit for bit to a run
    without it, at FLA's own state widths (B x H large enough) and, packed, at rewy's."""
    B, T, H, K, V = (1, 597, 2, 128, 64) if packed else (2, 300, 64, 128, 128)
    args, kw = _inputs("gdn", B, T, H, H, K, V, h0=not packed, seed=4)
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 200, 264, 597], device="cuda")
    do = torch.randn(B, T, H, V, device="cuda")
    dht = torch.randn(3 if packed else B, H, K, V, device="cuda")
    runs = {}
    # (The GPU tests cut every autotuner to one config, so the direct path runs from the first launch;
    # the check of its key rule against Triton 3.6's is the timing runs' part, which tune every config.)
    for direct in ("0", "1", "1"):
        monkeypatch.setenv("REWY_HF_DIRECT_LAUNCH", direct)
        runs.setdefault(direct, []).append(_grads(
            lambda *a, **k: rewy_hf.chunk_gated_delta_rule(*a, backend="triton", policy=policy, **k),
            args, kw, do, dht))
    for run in runs["1"]:
        assert all(torch.equal(x, y) for x, y in zip(run, runs["0"][0]))


def test_sequence_parallel_recurrences_match_fla():
    """The split state recurrences against FLA's sequential kernels on the same inputs."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    from rewy_hf.kernels.triton_state_scan import state_backward, state_forward

    B, T, H, K, V = 1, 4096, 2, 128, 128
    args, kw = _inputs("gdn", B, T, H, H, K, V, h0=True, seed=5)
    q, k, v, g, beta = args
    g2 = chunk_local_cumsum(g, chunk_size=64, scale=1.4426950408889634)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g2, beta=beta.bfloat16(), chunk_size=64)
    h0 = kw["initial_state"].float()
    h_ref, vn_ref, ht_ref = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g2, initial_state=h0,
                                                         output_final_state=True, chunk_size=64)
    h, vn, ht = state_forward(k, w, u, g2, h0, NS=8)
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(B, H, K, V, device="cuda")
    dv = chunk_bwd_dv_local(q=q, k=k, do=do, g=g2, scale=K ** -0.5, chunk_size=64)
    dh_ref, dh0_ref, dv2_ref = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, g=g2, h0=h0, dht=dht,
                                                              scale=K ** -0.5, chunk_size=64)
    dh, dh0, dv2 = state_backward(q, k, w, do, dv, g2, dht, K ** -0.5, NS=8)
    errs = {n: rel_err(a, b) for n, a, b in [("h", h, h_ref), ("v_new", vn, vn_ref), ("ht", ht, ht_ref),
                                          ("dh", dh, dh_ref), ("dh0", dh0, dh0_ref), ("dv2", dv2, dv2_ref)]}
    assert max(errs.values()) <= 1e-2, errs


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_sequence_parallel_op_matches_fp32_reference(monkeypatch, policy):
    monkeypatch.setenv("REWY_HF_SEQUENCE_PARALLEL", "5")
    B, T, H, K, V = 1, 2000, 2, 128, 128
    args, kw = _inputs("gdn", B, T, H, H, K, V, h0=True, seed=6)
    do = torch.randn(B, T, H, V, device="cuda")
    dht = torch.randn(B, H, K, V, device="cuda")
    f = rewy_hf.chunk_gated_delta_rule
    ref = _grads(lambda *a, **k: f(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: f(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs


def _recompute_against_reference(op, args, kw, B, T, HV, K, V, N):
    """The op under policy recompute against the fp32 torch backend; returns the dO and dht used."""
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(B, T, HV, V, device="cuda")
    dht = torch.randn(N, HV, K, V, device="cuda")
    ref = _grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = _grads(lambda *a, **k: fn(*a, backend="triton", policy="recompute", **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs
    return do, dht


def _walk_inputs(op, shape, packed, seed):
    """The walks' GPU cases: rows with an initial state, or three packed sequences with one each."""
    B, T, H, HV, K, V = shape
    args, kw = _inputs(op, B, T, H, HV, K, V, h0=not packed, seed=seed)
    N = 3 if packed else B
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 200, 264, T], device="cuda")
        kw["initial_state"] = 0.3 * torch.randn(N, HV, K, V, device="cuda")
    return args, kw, N


def _fla_forward_stages(op, args, kw):
    """q, k, v, beta (BF16), the packing kwargs, FLA's log2 gate cumsum and its w, u, A for the same inputs."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    q, k, v = args[:3]
    beta = args[-1].bfloat16()
    pk = {"cu_seqlens": kw["cu_seqlens"]} if "cu_seqlens" in kw else {}
    g2 = None if op == "delta_rule" else chunk_local_cumsum(args[3], chunk_size=64, scale=1.4426950408889634, **pk)
    w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g2, beta=beta, chunk_size=64, **pk)
    return q, k, v, beta, pk, g2, w, u, A


@pytest.mark.parametrize("op,shape,packed", [
    ("gdn", (2, 300, 2, 4, 128, 128), False),      # GVA, ragged T
    ("delta_rule", (1, 597, 4, 4, 128, 64), True),
])
def test_fused_prestage_matches_fp32_reference_and_flas_stages(op, shape, packed, monkeypatch):
    """REWY_HF_FUSED_PRESTAGE=1 (kernels/triton_gdn_prestage.py): the op's gradients against the fp32
    reference, and w, u, dV_loc against FLA's recompute_w_u_fwd and chunk_bwd_dv_local on the
    same BF16 inputs (the two round at different points, so to BF16 accuracy, not bit for bit)."""
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    from rewy_hf.kernels.triton_gdn_prestage import recompute_wu_and_dv_local

    monkeypatch.setenv("REWY_HF_FUSED_PRESTAGE", "1")
    B, T, H, HV, K, V = shape
    args, kw = _inputs(op, B, T, H, HV, K, V, h0=not packed, seed=6)
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 200, 264, 597], device="cuda")
    do, _ = _recompute_against_reference(op, args, kw, B, T, HV, K, V, 3 if packed else B)

    q, k, v, beta, pk, g2, _, _, A = _fla_forward_stages(op, args, kw)
    do16 = do.bfloat16()
    mine = recompute_wu_and_dv_local(q, k, v, beta, A, do16, g=g2, scale=K ** -0.5, **pk)
    theirs = (*recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g2, **pk),
              chunk_bwd_dv_local(q=q, k=k, do=do16, g=g2, scale=K ** -0.5, chunk_size=64, **pk))
    for name, a, b in zip(("w", "u", "dv_local"), mine, theirs):
        assert rel_err(a.float(), b.float()) < 1e-2, name


@pytest.mark.parametrize("op,shape,packed", [
    ("gdn", (2, 300, 2, 4, 128, 128), False),      # GVA, ragged T
    ("gdn", (1, 1100, 2, 2, 64, 128), True),       # one 64-row half
    ("delta_rule", (1, 597, 4, 4, 128, 64), True),
])
def test_walk_matches_fp32_reference_and_flas_reverse_recurrence(op, shape, packed, monkeypatch):
    """REWY_HF_GDN_WALK=1 (kernels/triton_gdn_walk.py): the op's gradients against the fp32 reference,
    and the walk's dh, dh0, dv2 against FLA's bwd_dhu fed FLA's local dv on the same BF16 inputs
    (the local dv rounds to BF16 before FLA's walk adds it, and not in rewy's, so to BF16 accuracy)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    from rewy_hf.kernels.triton_gdn_prestage import recompute_wu_and_scores
    from rewy_hf.kernels.triton_gdn_walk import reverse_walk

    monkeypatch.setenv("REWY_HF_GDN_WALK", "1")
    args, kw, N = _walk_inputs(op, shape, packed, seed=7)
    B, T, H, HV, K, V = shape
    do, dht = _recompute_against_reference(op, args, kw, B, T, HV, K, V, N)

    q, k, v, beta, pk, g2, w, _, A = _fla_forward_stages(op, args, kw)
    do16, h0 = do.bfloat16(), kw["initial_state"].float()
    _, _, st = recompute_wu_and_scores(q, k, v, beta, A, g=g2, scale=K ** -0.5, dtype=do16.dtype, **pk)
    mine = reverse_walk(q, k, w, st, do16, g=g2, h0=h0, dht=dht, scale=K ** -0.5, **pk)
    dv = chunk_bwd_dv_local(q=q, k=k, do=do16, g=g2, scale=K ** -0.5, chunk_size=64, **pk)
    theirs = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do16, dv=dv, g=g2, h0=h0, dht=dht, scale=K ** -0.5,
                                            **pk)
    for name, a, b in zip(("dh", "dh0", "dv2"), mine, theirs):
        assert rel_err(a.float(), b.float()) < 1e-2, name


@pytest.mark.parametrize("op,B,HV,walks", [
    ("gdn", 8, 16, True),           # N x HV x V / 64 = 256 programs: at least half the SMs, the walk
    ("delta_rule", 1, 16, False),   # 32 programs, under half of them: FLA's bwd_dhu
])
def test_walk_auto_picks_by_shape_and_matches_fp32_reference(op, B, HV, walks, monkeypatch):
    """REWY_HF_GDN_WALK unset (auto): the op runs rewy's walk exactly where the sequential launch
    fills half the GPU's SMs, FLA's bwd_dhu elsewhere, with gradients against the fp32 reference."""
    from rewy_hf.kernels import triton_gdn

    monkeypatch.delenv("REWY_HF_GDN_WALK", raising=False)
    ran = []
    walk, scores = triton_gdn.triton_gdn_walk.reverse_walk, triton_gdn.triton_gdn_prestage.recompute_wu_and_scores
    monkeypatch.setattr(triton_gdn.triton_gdn_walk, "reverse_walk", lambda *a, **k: ran.append(1) or walk(*a, **k))
    monkeypatch.setattr(triton_gdn.triton_gdn_prestage, "recompute_wu_and_scores",
                        lambda *a, **k: ran.append(2) or scores(*a, **k))
    T, K, V = 192, 128, 128
    args, kw = _inputs(op, B, T, HV, HV, K, V, h0=True, seed=9)
    _recompute_against_reference(op, args, kw, B, T, HV, K, V, B)
    assert ran == ([2, 1] if walks else []), ran


@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
@pytest.mark.parametrize("packed", [False, True])
def test_state_checkpoints_match_fp32_reference_and_the_sequential_rebuild(op, packed, monkeypatch):
    """Policy recompute with the states rebuilt from checkpoints (kernels/state_checkpoints.py):
    2-chunk segments against the fp32 torch backend, and they and auto (which leaves sequences
    this short whole) no less accurate (within 10 %) than the sequential rebuild
    (REWY_HF_STATE_CHECKPOINTS=off); the forward is the same run."""
    B, T, H, K, V = (1, 1100, 2, 128, 128) if packed else (2, 1000, 2, 128, 128)
    args, kw = _inputs(op, B, T, H, H, K, V, h0=not packed, seed=6)
    N = 3 if packed else B
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 130, 900, 1100], device="cuda")
        kw["initial_state"] = 0.3 * torch.randn(N, H, K, V, device="cuda")
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(B, T, H, V, device="cuda")
    dht = torch.randn(N, H, K, V, device="cuda")
    ref = _grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    errs = {}
    for mode in ("off", "2", "auto"):
        monkeypatch.setenv("REWY_HF_STATE_CHECKPOINTS", mode)
        ours = _grads(lambda *a, **k: fn(*a, backend="triton", policy="recompute", **k), args, kw, do, dht)
        errs[mode] = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs["2"]) <= BF16_TOL, errs
    for mode in ("2", "auto"):
        assert all(e <= 1.1 * s + 1e-3 for e, s in zip(errs[mode], errs["off"])), errs
