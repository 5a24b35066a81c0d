"""One rank of the context-parallel check (tests/ops/test_context_parallel.py), run in its own process.

Every rank builds the same float64 inputs of one packed row, runs the op on the whole row in one
process as the reference, then its own slice through FLA's ``build_cp_context`` with the gloo
group, and compares its slice's outputs and input gradients with the reference's.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

K, V = 8, 12
TOL = 1e-10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(op: str, T: int, H: int, HV: int, seed: int, K: int = K, V: int = V) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rnd(1, T, H, K), "k": F.normalize(rnd(1, T, H, K), dim=-1), "v": rnd(1, T, HV, V)}
    if op == "gdn":
        x |= {"g": F.logsigmoid(rnd(1, T, HV)) / 8, "beta": rnd(1, T, HV).sigmoid()}
    elif op == "kda":
        x |= {"g": F.logsigmoid(rnd(1, T, HV, K)) / 8, "beta": rnd(1, T, HV).sigmoid()}
    else:
        x |= {"g": F.logsigmoid(rnd(1, T, H, K)) / 8, "b": rnd(1, T, H, K).sigmoid(), "w": rnd(1, T, H, V).sigmoid()}
    return x


def _op(name):
    import rewy_hf

    return {"gdn": rewy_hf.chunk_gated_delta_rule, "kda": rewy_hf.chunk_kda, "gdn2": rewy_hf.chunk_gdn2}[name]


def check(op: str, bounds: list[int], H: int, HV: int, l2norm: bool, seed: int = 0) -> None:
    from fla.ops.cp import build_cp_context

    rank, world = dist.get_rank(), dist.get_world_size()
    T = bounds[-1]
    full = {n: x.requires_grad_() for n, x in inputs(op, T, H, HV, seed).items()}
    do = torch.randn(1, T, HV, V, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    cu = torch.tensor(bounds)
    o_ref, _ = _op(op)(**full, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm, backend="torch")
    grads_ref = torch.autograd.grad((o_ref * do).sum(), list(full.values()))

    part = T // world
    lo, hi = rank * part, (rank + 1) * part
    local = {n: x.detach()[:, lo:hi].clone().requires_grad_() for n, x in full.items()}
    ctx = build_cp_context(cu, group=dist.group.WORLD)
    o, ht = _op(op)(**local, cp_context=ctx, use_qk_l2norm_in_kernel=l2norm, backend="torch")
    assert ht is None
    grads = torch.autograd.grad((o * do[:, lo:hi]).sum(), list(local.values()))
    where = f"{op} bounds={bounds} world={world} rank={rank}"
    _close(o, o_ref[:, lo:hi], f"o, {where}")
    for name, g, g_ref in zip(local, grads, grads_ref):
        _close(g, g_ref[:, lo:hi], f"d{name}, {where}")


def _close(x: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (x - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    assert err <= TOL, f"{what}: relative error {err:.2e} > {TOL:.0e}"


def rank_main(rank: int, world: int, port: int, cases: list) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for case in cases:
            check(*case)
    finally:
        dist.destroy_process_group()


def check_cuda(op: str, bounds: list[int], H: int, HV: int) -> None:
    """The Triton backend on bf16 inputs, ranks sharing one GPU: the context-parallel slices must be
    as close to the float32 torch backend on the whole row as one process on the whole row is."""
    from fla.ops.cp import build_cp_context

    from rewy_hf.rel_error import rel_err

    rank, world = dist.get_rank(), dist.get_world_size()
    T = bounds[-1]
    x64 = inputs(op, T, H, HV, seed=0, K=128, V=128)
    x = {n: t.cuda().bfloat16() if n in ("q", "k", "v", "b", "w") else t.cuda().float() for n, t in x64.items()}
    do = torch.randn(1, T, HV, 128, generator=torch.Generator().manual_seed(1)).cuda()
    cu = torch.tensor(bounds, device="cuda")

    def run(backend, tensors, **kw):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
        o, _ = _op(op)(**leaves, backend=backend, use_qk_l2norm_in_kernel=True, **kw)
        part = slice(None) if o.shape[1] == T else slice(rank * (T // world), (rank + 1) * (T // world))
        return [o, *torch.autograd.grad((o.float() * do[:, part]).sum(), list(leaves.values()))]

    ref = run("torch", {n: t.float() for n, t in x.items()}, cu_seqlens=cu)
    one = run("triton", x, cu_seqlens=cu)
    lo, hi = rank * (T // world), (rank + 1) * (T // world)
    cp = run("triton", {n: t[:, lo:hi] for n, t in x.items()}, cp_context=build_cp_context(cu, group=dist.group.WORLD))
    for name, a, b, r in zip(["o", *x], cp, one, ref):
        e_cp, e_one = rel_err(a, r[:, lo:hi]), rel_err(b[:, lo:hi], r[:, lo:hi])
        assert e_cp <= 2 * e_one + 1e-3, f"{op} d{name} rank {rank}: context parallel {e_cp:.2e}, one process {e_one:.2e}"


def cuda_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for case in cases:
            check_cuda(*case)
    finally:
        dist.destroy_process_group()
