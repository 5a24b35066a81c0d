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

from op_grads import outputs_and_grads

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


@pytest.mark.parametrize("policy", ["recompute", "full"])
@pytest.mark.parametrize("op,shape", [
    ("gdn", (2, 300, 2, 4, 128, 128)),       # GVA, ragged T
    ("gdn", (1, 1024, 4, 4, 64, 128)),
    ("delta_rule", (2, 300, 4, 4, 128, 64)),
])
def test_triton_matches_fp32_reference(op, shape, policy):
    B, T, H, HV, K, V = shape
    args, kw = _inputs(op, B, T, H, HV, K, V, h0=True)
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(B, T, HV, V, device="cuda")
    dht = torch.randn(B, HV, K, V, device="cuda")
    ref = outputs_and_grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = outputs_and_grads(lambda *a, **k: fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs
    if op == "delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule as fla_delta

        theirs = outputs_and_grads(fla_delta, args, kw, do, dht)
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
    ref = outputs_and_grads(lambda *a, **k: f(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = outputs_and_grads(lambda *a, **k: f(*a, backend="triton", **k), args, kw, do, dht)
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
    ref = outputs_and_grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = outputs_and_grads(lambda *a, **k: fn(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    errs = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs) <= BF16_TOL, errs


def _launch_through_autotuners(monkeypatch):
    """Every kernel launch of the triton backend goes through the kernel's autotuner and wrappers."""
    from rewy_hf.kernels.triton_backend import fla_stages, state_launch
    from rewy_hf.kernels.triton_backend.scalar_gate import local_backward, prestage, reverse_walk

    for module in (fla_stages, state_launch, local_backward, prestage, reverse_walk):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, **kw: kernel[grid](**kw))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_direct_launch_changes_nothing_computed(monkeypatch, policy, packed):
    """rewy launches tuned kernels without their autotuner wrappers (kernels/triton_backend/launch.py):
    every output and gradient must equal bit for bit a run through the autotuners, at FLA's own state
    widths (B x H large enough; the reverse walk runs there under recompute) and, packed, at rewy's."""
    B, T, H, K, V = (1, 597, 2, 128, 64) if packed else (2, 300, 64, 128, 128)
    args, kw = _inputs("gdn", B, T, H, H, K, V, h0=not packed, seed=4)
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 200, 264, 597], device="cuda")
    do = torch.randn(B, T, H, V, device="cuda")
    dht = torch.randn(3 if packed else B, H, K, V, device="cuda")
    run = lambda: outputs_and_grads(
        lambda *a, **k: rewy_hf.chunk_gated_delta_rule(*a, backend="triton", policy=policy, **k), args, kw, do, dht)
    direct = [run(), run()]
    with pytest.MonkeyPatch.context() as mp:
        _launch_through_autotuners(mp)
        tuned = run()
    for grads in direct:
        assert all(torch.equal(x, y) for x, y in zip(grads, tuned))


def _recompute_against_reference(op, args, kw, B, T, HV, K, V, N):
    """The op under policy recompute against the fp32 torch backend; returns the dO and dht used."""
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(B, T, HV, V, device="cuda")
    dht = torch.randn(N, HV, K, V, device="cuda")
    ref = outputs_and_grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    ours = outputs_and_grads(lambda *a, **k: fn(*a, backend="triton", policy="recompute", **k), args, kw, do, dht)
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
    # tiles below 64 take the 8-warp configs only: the 4-warp ones fault there on the H200
    ("gdn", (1, 320, 2, 4, 16, 16), False),
    ("gdn", (1, 300, 2, 4, 32, 32), False),
])
def test_fused_prestage_matches_fp32_reference_and_flas_stages(op, shape, packed):
    """The fused prestage (scalar_gate/prestage.py): the op's gradients against the fp32
    reference, and w, u, dV_loc against FLA's recompute_w_u_fwd and chunk_bwd_dv_local on the
    same BF16 inputs (the two round at different points, so to BF16 accuracy, not bit for bit)."""
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    from rewy_hf.kernels.triton_backend.scalar_gate.prestage import recompute_wu_and_dv_local

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
    ("gdn", (1, 16384, 1, 1, 128, 128), False),    # a long walk: 256 chunks, BV 16 (the narrow rule)
    ("delta_rule", (1, 597, 4, 4, 128, 64), True),
])
def test_walk_matches_fp32_reference_and_flas_reverse_recurrence(op, shape, packed, monkeypatch):
    """rewy's reverse walk (scalar_gate/reverse_walk.py): the op's gradients against the fp32
    reference, and the walk's dh, dh0, dv2 against FLA's bwd_dhu fed the same local dv on the same
    BF16 inputs. The two differ in one rounding: the walk multiplies the gated queries as BF16, FLA
    as fp32, so they agree to BF16 accuracy."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    from rewy_hf.kernels.triton_backend.scalar_gate.reverse_walk import reverse_walk

    args, kw, N = _walk_inputs(op, shape, packed, seed=7)
    B, T, H, HV, K, V = shape
    do, dht = _recompute_against_reference(op, args, kw, B, T, HV, K, V, N)

    q, k, v, beta, pk, g2, w, _, A = _fla_forward_stages(op, args, kw)
    do16, h0 = do.bfloat16(), kw["initial_state"].float()
    dv = chunk_bwd_dv_local(q=q, k=k, do=do16, g=g2, scale=K ** -0.5, chunk_size=64, **pk)
    mine = reverse_walk(q, k, w, do16, dv, g=g2, h0=h0, dht=dht, scale=K ** -0.5, **pk)
    theirs = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do16, dv=dv, g=g2, h0=h0, dht=dht, scale=K ** -0.5,
                                            **pk)
    for name, a, b in zip(("dh", "dh0", "dv2"), mine, theirs):
        assert rel_err(a.float(), b.float()) < 1e-2, name


@pytest.mark.parametrize("op,B,HV", [
    ("gdn", 8, 16),           # N x HV x V / 32 = 512 programs: the GPU is full
    ("gdn", 1, 4),            # 16: most SMs idle, BV 16
    ("delta_rule", 1, 16),
])
def test_the_walk_serves_every_shape_and_matches_fp32_reference(op, B, HV, monkeypatch):
    """The op's reverse recurrence is rewy's walk whatever the launch fills (FLA's bwd_dhu does not
    run), with gradients against the fp32 reference."""
    from rewy_hf.kernels.triton_backend import state_launch
    from rewy_hf.kernels.triton_backend.scalar_gate import reverse_walk

    def refuse(*_, **__):
        raise AssertionError("FLA's bwd_dhu ran where the walk serves")

    ran = []
    walk = reverse_walk.reverse_walk
    monkeypatch.setattr(reverse_walk, "reverse_walk", lambda *a, **k: ran.append(1) or walk(*a, **k))
    monkeypatch.setattr(state_launch, "bwd_dhu", refuse)
    T, K, V = 192, 128, 128
    args, kw = _inputs(op, B, T, HV, HV, K, V, h0=True, seed=9)
    _recompute_against_reference(op, args, kw, B, T, HV, K, V, B)
    assert ran == [1], ran


@pytest.mark.parametrize("op", ["gdn", "delta_rule"])
@pytest.mark.parametrize("packed", [False, True])
def test_state_checkpoints_match_fp32_reference_and_the_sequential_rebuild(op, packed, monkeypatch):
    """Policy recompute with the states rebuilt from checkpoints (triton_backend/state_checkpoints.py):
    2-chunk segments against the fp32 torch backend, and they and the default rule (which leaves
    sequences this short whole) no less accurate (within 10 %) than the sequential rebuild."""
    from rewy_hf.kernels.triton_backend import state_checkpoints

    B, T, H, K, V = (1, 1100, 2, 128, 128) if packed else (2, 1000, 2, 128, 128)
    args, kw = _inputs(op, B, T, H, H, K, V, h0=not packed, seed=6)
    N = 3 if packed else B
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 130, 900, 1100], device="cuda")
        kw["initial_state"] = 0.3 * torch.randn(N, H, K, V, device="cuda")
    fn = rewy_hf.chunk_delta_rule if op == "delta_rule" else rewy_hf.chunk_gated_delta_rule
    do = torch.randn(B, T, H, V, device="cuda")
    dht = torch.randn(N, H, K, V, device="cuda")
    ref = outputs_and_grads(lambda *a, **k: fn(*a, backend="torch", **k), [a.float() for a in args], kw, do, dht)
    errs = {}
    for mode in ("off", "2", "auto"):
        with pytest.MonkeyPatch.context() as mp:
            if mode == "off":
                mp.setattr(state_checkpoints, "plan", lambda *_: None)
            elif mode == "2":
                mp.setattr(state_checkpoints, "chunks_per_segment", lambda *_: 2)
                mp.setattr(state_checkpoints, "MIN_CHUNKS", 2)        # the shortest segment, which bounds their count
            ours = outputs_and_grads(lambda *a, **k: fn(*a, backend="triton", policy="recompute", **k), args, kw,
                                     do, dht)
        errs[mode] = [rel_err(x, r) for x, r in zip(ours, ref)]
    assert max(errs["2"]) <= BF16_TOL, errs
    for mode in ("2", "auto"):
        assert all(e <= 1.1 * s + 1e-3 for e, s in zip(errs[mode], errs["off"])), errs
