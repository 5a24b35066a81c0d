"""One rank of the context-parallel check (tests/ops/test_context_parallel.py), run in its own process.

Every rank builds the same float64 inputs of one packed row, runs the op on the whole row in one
process as the reference, then its own slice through FLA's ``build_cp_context`` with the gloo
group, and compares its slice's outputs and input gradients with the reference's.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import os
import re
import socket
import sys

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


def _close(x: torch.Tensor, ref: torch.Tensor, what: str, tol: float = TOL) -> None:
    err = _max_rel(x, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _serve(rank: int, world: int, port: int, cases: list, check_case, timeout_s: int) -> None:
    """Join the gloo group of ``world`` processes and run ``check_case(*case)`` for every case."""
    # A rank that dies in native code (SIGABRT, SIGSEGV) prints its Python stack to the test's stderr.
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for case in cases:
            check_case(*case)
        # No rank tears its connections down while another still finishes its last collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check has passed and the group is gone: leave without the interpreter's teardown, where
    # nothing is checked and where a rank has died of SIGABRT on CI ("terminate called without an
    # active exception": a native thread destroyed while still running).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve(rank, world, port, cases, check, 120)


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


def _serve_on_gpu(rank: int, world: int, port: int, cases: list, check_case) -> None:
    # As tests/conftest.py does for the parent process: one config per autotuned kernel, set before
    # FLA defines its kernels. A spawned rank does not read conftest.py, and without the cut both
    # ranks tune every FLA and rewy kernel cold, for many minutes, before their first exchange.
    from rewy_hf.cpu_triton import first_config_only

    first_config_only()
    torch.cuda.set_device(0)
    _serve(rank, world, port, cases, check_case, 300)


def cuda_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_on_gpu(rank, world, port, cases, check_cuda)


def check_model(kind: str, bounds: list[int], checkpointing: bool = False, tol: float = 2e-5) -> None:
    """A tiny patched model (float32, torch backend): each rank's logits over its slice of the packed
    row, and the rank-summed parameter gradients of the row's mean next-token loss, equal one process
    on the whole row."""
    from fla.ops.cp import build_cp_context

    import rewy_hf
    from support import fla_tiny_models as tiny

    # Without the short convolution: FLA's exchange for it (which context_parallel hands the context,
    # tests/patching/test_context_parallel_model.py) does not run in the Triton interpreter.
    model = tiny.build(kind, use_short_conv=False) if kind != "gdn2" else _gdn2_model()
    rewy_hf.patch_model(model, backend="torch")
    if checkpointing:
        model.activation_checkpointing_enable()
    ids = torch.randint(0, tiny.VOCAB, (1, bounds[-1]), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor(bounds)
    targets, loss_of = _targets_and_loss(ids, cu)
    ref_logits = model(input_ids=ids, cu_seqlens=cu).logits
    ref_grads = torch.autograd.grad(loss_of(ref_logits, targets), list(model.parameters()), allow_unused=True)
    ctx = build_cp_context(cu, group=dist.group.WORLD)
    _check_split(model, ids, targets, loss_of, ref_logits, ref_grads, ctx, f"{kind} bounds={bounds}",
                 checkpointing, tol, cu_seqlens=ctx.cu_seqlens)


def _targets_and_loss(ids: torch.Tensor, cu: torch.Tensor):
    """The next token of each position of a packed row (none at a sequence's last one), and the
    row's mean next-token loss of a slice's logits against its targets."""
    targets = torch.cat([ids[0, 1:], ids.new_full((1,), -100)])
    targets[cu[1:] - 1] = -100
    count = int((targets != -100).sum())

    def loss_of(logits, tgt):
        return F.cross_entropy(logits[0].float(), tgt, ignore_index=-100, reduction="sum") / count

    return targets, loss_of


def _check_split(model, ids, targets, loss_of, ref_logits, ref_grads, ctx, what: str, checkpointing: bool,
                 tol: float, cp_kwargs: dict | None = None, ref32=None, **forward_kwargs) -> None:
    """This rank's slice of the row run inside ``context_parallel``: its logits, and the rank-summed
    parameter gradients of the row's mean loss, against the references (with ``ref32``, the float32
    model's logits and gradients: as close to them as the one-process references are)."""
    import rewy_hf

    rank, world = dist.get_rank(), dist.get_world_size()
    part = ids.shape[1] // world
    lo, hi = rank * part, (rank + 1) * part
    # The backward inside the block as well: checkpointed layers rerun their forward there.
    with rewy_hf.context_parallel(model, ctx, **(cp_kwargs or {})):
        logits = model(input_ids=ids[:, lo:hi], **forward_kwargs).logits
        grads = torch.autograd.grad(loss_of(logits, targets[lo:hi]), list(model.parameters()), allow_unused=True)
    where = f"{what} checkpointing={checkpointing} world={world} rank={rank}"
    _compare(logits, ref_logits[:, lo:hi], None if ref32 is None else ref32[0][:, lo:hi], f"logits, {where}", tol)
    _compare_grads(model, grads, ref_grads, ref32, where, tol)


def _compare_grads(model, grads, ref_grads, ref32, where: str, tol: float) -> None:
    """Each parameter's gradient summed over the ranks against the references (``_compare``). With
    ``ref32``, a parameter's one-process error is taken as the largest over the parameters of its kind
    (its name with the layer index dropped): a gate parameter's gradient is a sum of cancelling terms
    over every token, so one layer's bf16 error is one draw of that rounding noise and can be far below
    its typical size (Kimi-Linear's ``forget_gate.A_log`` in bf16 on an H100, one process: 1.1e-3 in
    layer 0, 3.1e-2 in layer 2; context parallel 1.4e-2 and 2.4e-2)."""
    named = [(name, g, g_ref, None if ref32 is None else ref32[1][i])
             for i, ((name, _), g, g_ref) in enumerate(zip(model.named_parameters(), grads, ref_grads))
             if g_ref is not None]
    noise: dict[str, float] = {}
    for name, _, g_ref, r32 in named:
        if r32 is not None:
            kind = _kind(name)
            noise[kind] = max(noise.get(kind, 0.0), _max_rel(g_ref, r32))
    for name, g, g_ref, r32 in named:
        g, spread = _rank_sum(g)
        _compare(g, g_ref, r32, f"d {name}, {where}", tol, spread, noise.get(_kind(name), 0.0))


def _kind(name: str) -> str:
    """A parameter's name without its layer index: ``model.layers.N.self_attn.forget_gate.A_log``."""
    return re.sub(r"\.\d+\.", ".N.", name)


def _rank_sum(g: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The sum over ranks of each rank's parameter gradient (in float32), and the sum over ranks of
    each one's largest magnitude: each rank's gradient was rounded to its dtype before the sum, by
    up to that dtype's unit in each of them."""
    g = g.float().cpu()
    spread = g.abs().max().reshape(1)
    dist.all_reduce(g)
    dist.all_reduce(spread)
    return g, spread.item()


def _max_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float().cpu(), ref.float().cpu()
    return (x - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _compare(x: torch.Tensor, one: torch.Tensor, ref32: torch.Tensor | None, what: str, tol: float,
             spread: float = 0.0, noise: float = 0.0) -> None:
    """Without ``ref32``: ``x`` equals the one-process result ``one`` within ``tol``. With it (bf16 on a
    GPU): ``x`` is as close to the float32 model as ``one`` is (or as the one-process run is on the
    parameters of its kind, ``noise``: ``_compare_grads``), as in ``check_cuda``, plus the rounding of
    each rank's part of a summed gradient (``spread``: ``_rank_sum``'s sum of the parts' largest
    magnitudes). A gate parameter's gradient sums cancelling terms over every token, so its parts can
    be larger than their sum, and their rounding with them."""
    if ref32 is None:
        _close(x.float().cpu(), one.float().cpu(), what, tol)
        return
    scale = max(ref32.float().abs().max().item(), 1e-30)
    e_cp, e_one = _max_rel(x, ref32), max(_max_rel(one, ref32), noise)
    parts = torch.finfo(one.dtype).eps / 2 * spread / scale
    assert e_cp <= 2 * e_one + parts + 1e-3, (f"{what}: context parallel {e_cp:.2e} off the float32 model, one "
                                              f"process {e_one:.2e}, rounding of the ranks' parts {parts:.2e}")


def _gdn2_model(use_short_conv: bool = False):
    """A tiny GDN2 model. Its short convolution runs in plain torch on the CPU for a plain call
    (models/gdn2/cpu_modules.py); a packed call goes to FLA's, which the interpreter cannot run, so
    only a compiled context-parallel run (rewy's convolution there) takes it."""
    from rewy_hf.models.gdn2 import GDN2Config, GDN2ForCausalLM

    from support import fla_tiny_models as tiny

    torch.manual_seed(0)
    config = GDN2Config(vocab_size=tiny.VOCAB, hidden_size=tiny.HIDDEN, num_hidden_layers=2, num_heads=2, head_dim=16,
                        fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False, use_short_conv=use_short_conv)
    return GDN2ForCausalLM(config).train()


def _serve_interpreted(rank: int, world: int, port: int, cases: list, check_case) -> None:
    # As tests/conftest.py does for the parent process: FLA's kernels under the interpreter.
    from rewy_hf.cpu_triton import enable_cpu_interpreter

    enable_cpu_interpreter()
    torch.set_num_threads(1)
    _serve(rank, world, port, cases, check_case, 300)


def model_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_interpreted(rank, world, port, cases, check_model)


def check_hf_model(family: str, bounds: list[int], checkpointing: bool = False, device: str = "cpu",
                   tol: float = 2e-5, hybrid: bool = False) -> None:
    """A tiny patched transformers model (on the CPU: float32, torch backend; on a GPU: bf16, Triton
    backend), its convolution included, split across the ranks: each rank's logits over its slice of
    the packed row, and the rank-summed parameter gradients of the row's mean next-token loss, equal
    the model run on every sequence on its own in one process (transformers' own convolution and
    attention, no packing). Every layer a delta-rule layer, or with ``hybrid`` the tiny config's
    delta-rule, full-attention, delta-rule layers, whose attention then attends over the whole row
    (patching/context_parallel_attention.py). On a GPU "equal" means as close to the float32 model
    (same weights, torch backend) as the one bf16 process is."""
    from fla.ops.cp import build_cp_context

    import rewy_hf
    from rewy_hf.models.causal_masks import causal_only_masks
    from rewy_hf.patching.context_parallel_attention import RowAttention
    from support import hf_tiny_models as hf

    # bf16 on a GPU: every expert routed (hf_tiny_models.make_config says why)
    gpu = device == "cuda"
    if hybrid:
        model = hf.build(family, route_all_experts=gpu)
        model.config.use_cache = False
        assert "full_attention" in model.config.layer_types
    else:
        model = hf.delta_rule_only(family, route_all_experts=gpu)
    twin = None
    if gpu:
        model = model.to("cuda", torch.bfloat16)
        twin = _float32_twin(model)
    rewy_hf.patch_model(model, backend="torch" if device == "cpu" else "triton")
    if checkpointing:
        model.activation_checkpointing_enable()
    ids = torch.randint(0, hf.VOCAB, (1, bounds[-1]), generator=torch.Generator().manual_seed(3)).to(device)
    cu = torch.tensor(bounds, device=device)
    targets, loss_of = _targets_and_loss(ids, cu)
    pieces = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    ref_logits, ref_grads = _per_sequence(model, ids, pieces, targets, loss_of)
    ref32 = None if twin is None else _per_sequence(twin, ids, pieces, targets, loss_of)
    ctx = build_cp_context(cu, group=dist.group.WORLD, conv1d_kernel_size=model.config.linear_conv_kernel_dim)
    row = {}
    if hybrid:
        row = dict(cp_kwargs={"cu_seqlens": cu}, position_ids=RowAttention(cu, dist.group.WORLD).positions(device),
                   attention_mask=causal_only_masks(model))
    _check_split(model, ids, targets, loss_of, ref_logits, ref_grads, ctx,
                 f"{family}{' hybrid' if hybrid else ''} bounds={bounds}", checkpointing, tol, ref32=ref32, **row)


def _float32_twin(model):
    """The bf16 model's weights in float32, on the torch backend: the reference a bf16 run's error
    is measured from."""
    import rewy_hf

    twin = copy.deepcopy(model).float()
    rewy_hf.patch_model(twin, backend="torch")
    return twin


def _per_sequence(model, ids, pieces, targets, loss_of):
    """Every sequence of the row run on its own: the row's logits and the parameter gradients of its
    mean loss."""
    logits = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in pieces], dim=1)
    return logits, torch.autograd.grad(loss_of(logits, targets), list(model.parameters()), allow_unused=True)


def check_hf_model_cuda(family: str, bounds: list[int]) -> None:
    # bf16: the two sides round their states at different places (the exchanged summaries are float32).
    check_hf_model(family, bounds, device="cuda")


def hf_model_cuda_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_on_gpu(rank, world, port, cases, check_hf_model_cuda)


def hf_model_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_interpreted(rank, world, port, cases, check_hf_model)


def check_hf_hybrid(family: str, bounds: list[int], checkpointing: bool = False) -> None:
    check_hf_model(family, bounds, checkpointing, hybrid=True)


def hf_hybrid_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_interpreted(rank, world, port, cases, check_hf_hybrid)


def check_hf_hybrid_cuda(family: str, bounds: list[int]) -> None:
    check_hf_model(family, bounds, device="cuda", hybrid=True)


def hf_hybrid_cuda_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_on_gpu(rank, world, port, cases, check_hf_hybrid_cuda)


def check_compiled(kind: str, rows: list[list[int]], device: str = "cpu") -> None:
    """A tiny patched model compiled whole with inductor (``fullgraph=True``: any graph break fails), split across
    the ranks on each packing in ``rows`` in turn: each rank's logits and the rank-summed parameter
    gradients of the row's mean loss equal each sequence run on its own, eagerly, in one process.
    ``kind``: "gdn2" (rewy's GDN2 model, FLA's layers with their short convolution) or a
    transformers hybrid family (delta-rule, attention and delta-rule layers). At most two graphs
    over the packings (see the end). On a GPU: bf16, the
    Triton backend and inductor, as close to the float32 model as the one bf16 process is."""
    from fla.ops.cp import build_cp_context
    from torch._dynamo.testing import CompileCounterWithBackend

    import rewy_hf
    from rewy_hf.models.causal_masks import causal_only_masks
    from rewy_hf.patching.context_parallel_attention import RowAttention
    from support import hf_tiny_models as hf

    hybrid = kind != "gdn2"
    if hybrid:
        model = hf.build(kind)
        model.config.use_cache = False
    else:
        model = _gdn2_model(use_short_conv=True)
    gpu = device == "cuda"
    twin = None
    if gpu:
        model = model.to("cuda", torch.bfloat16)
        twin = _float32_twin(model)
    rewy_hf.patch_model(model, backend="triton" if gpu else "torch")
    if not hybrid:
        # FLA's GDN2 layer calls einops on a tensor and on a parameter, and dynamo guards on the size of
        # einops' registry of tensor types, which grows at its first parameter: without these two calls
        # the first graph is dropped after its first run, a one-time recompile that is einops' own.
        import einops

        einops.rearrange(torch.zeros(1, 1), "a b -> b a")
        einops.rearrange(torch.nn.Parameter(torch.zeros(1, 1)), "a b -> b a")
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    for bounds in rows:
        T = bounds[-1]
        ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(T + len(bounds))).to(device)
        cu = torch.tensor(bounds, device=device)
        targets, loss_of = _targets_and_loss(ids, cu)
        pieces = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        ref_logits, ref_grads = _per_sequence(model, ids, pieces, targets, loss_of)
        ref32 = None if twin is None else _per_sequence(twin, ids, pieces, targets, loss_of)
        ctx = build_cp_context(cu, group=dist.group.WORLD, conv1d_kernel_size=4)
        lo, hi = rank * (T // world), (rank + 1) * (T // world)
        if hybrid:
            inputs = dict(position_ids=RowAttention(cu, dist.group.WORLD).positions(device),
                          attention_mask=causal_only_masks(model))
        else:
            inputs = dict(cu_seqlens=ctx.cu_seqlens)
        with rewy_hf.context_parallel(model, ctx, cu_seqlens=cu if hybrid else None):
            logits = compiled(input_ids=ids[:, lo:hi], **inputs).logits
            grads = torch.autograd.grad(loss_of(logits, targets[lo:hi]), list(model.parameters()), allow_unused=True)
        where = f"compiled {kind} bounds={bounds} rank={rank}"
        _compare(logits, ref_logits[:, lo:hi], None if ref32 is None else ref32[0][:, lo:hi], f"logits, {where}", 2e-5)
        _compare_grads(model, grads, ref_grads, ref32, where, 2e-5)
    # rewy_hf.context_parallel marks the per-row sizes dynamic, so a new packing does not compile again,
    # except that dynamo specialises a size of 1: a rank holding one (partial) sequence gets a graph of
    # its own. Two graphs at most, whatever the packings.
    assert len(rows) > 2 and 0 < counter.frame_count <= 2, f"{kind}: {counter.frame_count} compiles for {len(rows)} packings"


def compiled_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_interpreted(rank, world, port, cases, check_compiled)


def check_compiled_cuda(kind: str, rows: list[list[int]]) -> None:
    check_compiled(kind, rows, device="cuda")


def compiled_cuda_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve_on_gpu(rank, world, port, cases, check_compiled_cuda)


def bench_rank_main(rank: int, world: int, port: int, argv: list[str], codes: str) -> None:
    """One process of a `dev/bench_lab --context-parallel` launch, as torchrun starts it (its
    environment); ``argv``: ``bench`` and the options, as for `rewy-hf bench`, whose options the
    developer bench extends. Its exit status goes to the file ``codes``.<rank>."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from bench_cli import lab_main

    assert argv[0] == "bench", argv
    code = lab_main(argv[1:])
    with open(f"{codes}.{rank}", "w") as fh:
        fh.write(str(code))


def check_attention_dropout() -> None:
    """The context-parallel attention op with dropout, one rank: with a fixed seed the forward is a
    function of q, k and v, and its backward (a rerun under the same seed) is that function's
    gradient (float64 gradcheck); the dropout does act (the output differs from no dropout)."""
    import importlib

    importlib.import_module("rewy_hf.kernels.context_parallel_attention")      # registers the ops

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bounds, name, seed = torch.tensor([0, 7, 16]), dist.group.WORLD.group_name, torch.tensor(12345)

    def attend(q, k, v, dropout=0.3):
        return torch.ops.rewy.cp_row_attention(q, k, v, bounds, name, dropout, None, seed if dropout else None)

    assert torch.autograd.gradcheck(attend, (q, k, v), eps=1e-6, atol=1e-6)
    assert not torch.allclose(attend(q, k, v), attend(q, k, v, dropout=0.0))


def attention_dropout_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve(rank, world, port, cases, check_attention_dropout, 120)


def check_refusals() -> None:
    """Contexts and row bounds that do not describe one packed row, entering ``context_parallel`` on
    every rank of two: each rank refuses, saying what is wrong, where a rank that passed its own
    checks would otherwise wait in the first exchange for one that refused; a consistent row enters."""
    from fla.ops.cp import build_cp_context

    import rewy_hf

    rank = dist.get_rank()
    model = _gdn2_model()
    rewy_hf.patch_model(model, backend="torch")

    def ctx(bounds):
        return build_cp_context(torch.tensor(bounds), group=dist.group.WORLD)

    cases = [
        # FLA's rank 0 sends its last sequence on, its rank 1 expects none
        ("unsorted bounds", ctx([0, 150, 100, 200]), None,
         "rank 0's context says its last sequence runs on into rank 1's slice, but rank 1's says its first "
         "sequence starts there"),
        ("contexts from different rows", ctx([[0, 50, 200], [0, 150, 200]][rank]), None,
         "ranks 0 and 1 disagree on where the sequence they share starts or ends"),
        # rank 1's slice is the same under both bounds: only rank 0 can see the difference
        ("row bounds other than the context's", ctx([0, 50, 100, 200]), [0, 60, 100, 200],
         ["cu_seqlens=[0, 60, 100, 200] are not the bounds cp_context was built from",
          "rank(s) [0] refused the row's context"][rank]),
        # each rank's bounds are its context's, and the two contexts chain as the row [0, 200] would
        ("different row bounds per rank", ctx([[0, 150, 200], [0, 200]][rank]), [[0, 150, 200], [0, 200]][rank],
         "the ranks passed context_parallel different cu_seqlens"),
    ]
    for what, context, row, fragment in cases:
        try:
            with rewy_hf.context_parallel(model, context, cu_seqlens=None if row is None else torch.tensor(row)):
                pass
        except rewy_hf.UnsupportedConfigError as exc:
            assert fragment in str(exc), f"{what}, rank {rank}: {exc}"
        else:
            raise AssertionError(f"{what}, rank {rank}: context_parallel accepted it")
    with rewy_hf.context_parallel(model, ctx([0, 50, 200]), cu_seqlens=torch.tensor([0, 50, 200])):
        pass


def refusal_rank_main(rank: int, world: int, port: int, cases: list) -> None:
    _serve(rank, world, port, cases, check_refusals, 60)
