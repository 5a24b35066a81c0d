"""``--context-parallel``: one packed row split across the processes of a launch
(``torchrun --nproc-per-node N $REPO/dev/bench_lab --context-parallel ...``), rewy's op against FLA's on
each process's slice with FLA's ``cp_context``. A round runs each side the same number of times on
every process (their collectives pair up) and takes the slowest process's time; each configuration
is first checked against rewy's float32 torch backend on the whole row. On the CPU (gloo) only rewy's
side runs: FLA's context-parallel kernels need CUDA."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist

from rewy_hf.bench import timing
from rewy_hf.bench.config import BOUNDARIES, check_T, environment, expand, given, resolve_shapes
from rewy_hf.bench.op_bench import Settings, fla_impl, guard_lifted, rewy_impl
from rewy_hf.bench.rows import as_json
from rewy_hf.bench.runner import op_settings
from rewy_hf.bench.tables import cell, table
from rewy_hf.bench.timing import describe, free_memory, leaves, runner
from rewy_hf.op_inputs import DISPATCH_NAME, GRAD_NAMES, REWY_OPS, Shape, make_inputs
from rewy_hf.rel_error import rel_err
from rewy_hf.validation import POLICIES

CP_OPS = ("gdn", "kda", "gdn2")          # FLA 0.6.0 has context parallelism for these (not DeltaNet)
INNER_RUNS = {"cuda": 10, "cpu": 1}       # runs per timed round, the same on every process


@dataclass
class CPRow:
    """One configuration of the context-parallel bench: per boundary and side (FLA, rewy) the median
    round in ms, per side the peak memory of one process and the check's worst relative error, and
    why a side did not run or is not held to a bound (``errors``)."""
    op: str
    policy: str
    shape: str                      # the packed row's label, B,T,H[,K,V],packed=N
    processes: int
    tokens_per_process: int
    boundaries: list[str]
    ms: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_mb: dict[str, float | None] = field(default_factory=dict)
    err: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    dispatch_name: str = ""
    grad_names: list[str] = field(default_factory=list)
    check_T: int = 0
    bound: float = 0.0
    passed: bool = False            # "pass" on disk

    def to_json(self) -> dict:
        out = asdict(self)
        out["pass"] = out.pop("passed")
        return out

    @classmethod
    def from_json(cls, d: dict) -> "CPRow":
        return cls(**{f.name: d["pass" if f.name == "passed" else f.name] for f in fields(cls)
                      if ("pass" if f.name == "passed" else f.name) in d})


def launched_world() -> tuple[int, int] | None:
    """(rank, world) of a torchrun / accelerate launch, or None when not launched with 2 or more."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), world


def start(device: str) -> str:
    """Join the launch's process group (NCCL on CUDA, one GPU per process; gloo on the CPU); the device."""
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return "cpu"


def _slice(x: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    part = x.shape[1] // world
    return x[:, rank * part:(rank + 1) * part].contiguous()


def _with_context(fn, ctx):
    """An op bench side (``op_bench.rewy_impl`` / ``fla_impl``) called with ``cp_context``."""
    return lambda *x: fn(*x, cp_context=ctx)


def _worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _row(shape: Shape, device: str, dtype: torch.dtype, op: str, seed: int):
    """The whole row's inputs and output gradient, FLA's context for it, and this process's slices."""
    from fla.ops.cp import build_cp_context

    cu = shape.packing(device).get("cu_seqlens")
    if cu is None:
        cu = torch.tensor([0, shape.T], dtype=torch.long, device=device)
    inputs, do = make_inputs(op, shape, device, dtype, seed)
    ctx = build_cp_context(cu, group=dist.group.WORLD, cu_seqlens_cpu=cu.cpu())
    return inputs, do, cu, ctx, [_slice(x) for x in inputs], _slice(do)


def check_side(op: str, fn_of_ctx, shape: Shape, s: Settings, dtype: torch.dtype) -> float:
    """The worst relative error over the processes of a side's slice (output and input gradients)
    against rewy's float32 torch backend on the whole row in one process."""
    inputs, do, cu, ctx, mine, do_mine = _row(shape, s.device, dtype, op, s.seed + 1)
    ref_in = leaves([x.float() for x in inputs])
    o_ref = REWY_OPS[op](*ref_in, cu_seqlens=cu, backend="torch")[0]
    ref = [_slice(o_ref.detach()), *(_slice(g) for g in torch.autograd.grad(o_ref, ref_in, do.float()))]
    xs = leaves(mine)
    o = fn_of_ctx(ctx)(*xs)
    got = [o.detach(), *torch.autograd.grad(o, xs, do_mine)]
    return _worst(max(rel_err(a.float(), b) for a, b in zip(got, ref)))


def time_sides(runs: dict, s: Settings) -> dict[str, float]:
    """Median over rounds of the slowest process's time per run, per side (ms); the sides alternate."""
    kind = torch.device(s.device).type
    inner = INNER_RUNS[kind]
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(s.warmup + s.reps):
        for name, run in runs.items():
            dist.barrier()
            timing.sync(kind)
            t0 = time.perf_counter()
            for _ in range(inner):
                run()
            timing.sync(kind)
            ms = (time.perf_counter() - t0) * 1e3 / inner
            ms = _worst(ms)
            if i >= s.warmup:
                samples[name].append(ms)
    return {name: statistics.median(v) for name, v in samples.items()}


def peak_mb(fn, inputs, do, device: str) -> float | None:
    """The largest peak over the processes of one forward + backward (timing.peak_mb); None on CPU."""
    return _worst(timing.peak_mb(fn, inputs, do)) if device.startswith("cuda") else None


def run_row(op: str, policy: str, shape: Shape, boundaries: list[str], s: Settings) -> CPRow:
    """One configuration: the check, then the timing of each side that passed it."""
    cuda = s.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    world = dist.get_world_size()
    row = CPRow(op, policy, shape.label, world, shape.T // world, boundaries, dispatch_name=DISPATCH_NAME[op],
                grad_names=list(GRAD_NAMES[op]))
    sides = {"rewy": lambda ctx: _with_context(rewy_impl(op, s.backend, policy).fn, ctx)}
    if cuda:
        sides["FLA"] = lambda ctx: _with_context(fla_impl(op, policy, s.gdn_guard).fn, ctx)
    else:
        row.errors["FLA"] = "not run: FLA's context-parallel kernels are Triton kernels and need CUDA"
    trusted_fla = not guard_lifted(op, s.gdn_guard)
    cT = check_T(shape, s.check_max_tokens)
    row.check_T = cT = cT - cT % world
    for name, side in list(sides.items()):
        try:
            row.err[name] = check_side(op, side, shape.with_T(cT), s, dtype)
        except Exception as exc:        # every process fails alike: its collectives would not pair up otherwise
            row.errors[name] = describe(exc)
            del sides[name]
    if "FLA" in row.err and not trusted_fla:
        row.errors["FLA note"] = "timing only: FLA's GDN backward guard was lifted, its error is not a bound"
    row.bound = (1.1 * row.err["FLA"] + 1e-5) if "FLA" in row.err and trusted_fla else 1e-2
    row.passed = "rewy" in row.err and row.err["rewy"] <= row.bound
    inputs, do, _, ctx, mine, do_mine = _row(shape, s.device, dtype, op, s.seed)
    del inputs, do
    for boundary in boundaries:
        runs = {name: runner(boundary, side(ctx), mine, do_mine) for name, side in sides.items()}
        row.ms[boundary] = time_sides(runs, s)
        del runs
        free_memory("cuda" if cuda else "cpu")
    for name, side in sides.items():
        row.peak_mb[name] = peak_mb(side(ctx), mine, do_mine, s.device)
    return row


LAUNCH = "torchrun --nproc-per-node 2 $REPO/dev/bench_lab --context-parallel ..."


def refusal(args) -> str | None:
    """Why a --context-parallel run cannot start, with the fix; None when it can."""
    if launched_world() is None:
        return (f"--context-parallel splits one row across 2 or more processes: launch them, e.g. `{LAUNCH}` "
                "(one GPU per process on CUDA, gloo on CPU)")
    if args.model:
        return "--context-parallel is an op-level bench; the recipe's --context-parallel trains a model that way"
    if taken := given(args, "--peers", "--kernel-profile", "--plot", "--keep-autotune-picks"):
        return (f"--context-parallel times rewy against FLA only, with neither {', '.join(taken)}; drop "
                f"{'it' if len(taken) == 1 else 'them'} (the op bench without --context-parallel takes them)")
    ops = [op for op in (args.op or CP_OPS) if op != "all"]
    if "delta_rule" in ops:
        return "--context-parallel: FLA 0.6.0 has no context parallelism for delta_rule; pick from gdn, kda, gdn2"
    for spec in args.shapes or []:
        if spec == "suite" or spec.B != 1:
            return ("--context-parallel takes one packed row per shape: give 1,T,H[,K,V][,packed=N] "
                    "(B = 1; T divisible by the number of processes)")
        if spec.T % launched_world()[1]:
            return f"--context-parallel: T = {spec.T} does not split evenly over {launched_world()[1]} processes"
    if not args.shapes:
        return "--context-parallel needs --shapes 1,T,H[,K,V][,packed=N] (one packed row per shape)"
    return None


def run_cp(args, device: str, guard: dict, report) -> int:
    """The --context-parallel bench on this process (every process of the launch runs it); the
    first process prints the table and writes the --json report."""
    rank, world = launched_world()
    lead = rank == 0
    shapes, _ = resolve_shapes(args.shapes, device)
    s = dataclasses.replace(op_settings(args, device, guard), device=start(device))
    data = {"kind": "context_parallel", **environment(device), "processes": world,
            "settings": {"backend": args.backend, "reps": s.reps, "warmup": s.warmup, "seed": s.seed,
                         "runs_per_round": INNER_RUNS["cpu" if device == "cpu" else "cuda"],
                         "timing": "per round, the slowest process's time per run; the median round",
                         "gdn_guard": guard}, "rows": []}
    if lead:
        print(f"bench_lab --context-parallel on {world} processes ({data['device_name']}): rewy's ops against "
              "FLA 0.6.0's, each process on its slice of one packed row")
        if device == "cpu":
            print("NOTE: CPU run (gloo): FLA's side needs CUDA, so only rewy's side runs; these times say nothing "
                  "about a GPU.")
    for shape in shapes:
        for op in expand(args.op, CP_OPS, "all", CP_OPS):
            for policy in expand(args.policy, POLICIES, "both", POLICIES):
                row = run_row(op, policy, shape, expand(args.boundary, BOUNDARIES, "both", BOUNDARIES), s)
                data["rows"].append(row)
                if lead:
                    ms = ", ".join(f"{b}: " + " / ".join(f"{n} {v:.3f} ms" for n, v in t.items())
                                   for b, t in row.ms.items())
                    print(f"{op} {policy} {shape.label}: {ms}; err rewy {row.err.get('rewy', float('nan')):.1e}"
                          f"{'' if row.passed else '  CHECK FAILED'}", flush=True)
                    report.save(as_json(data))
    failed = not all(row.passed for row in data["rows"])
    data["complete"], data["exit_code"] = True, 1 if failed else 0
    if lead:
        print(format_cp_rows(data["rows"]))
        report.finish(as_json(data))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def format_cp_rows(rows: list) -> str:
    """The context-parallel table (Markdown, printed as it is): per configuration and boundary, each
    side's ms, the row's tokens per second and the speed-up (FLA / rewy), peak MB per process and the check."""
    head = ["op", "policy", "row", "processes", "boundary", "FLA ms", "rewy ms", "speed-up", "rewy tokens/s",
            "peak MB FLA / rewy", "err FLA / rewy", "pass"]
    body = []
    for r in rows:
        T = r.tokens_per_process * r.processes
        for boundary, ms in r.ms.items():
            fla, rewy = ms.get("FLA"), ms.get("rewy")
            body.append([r.op, r.policy, r.shape, str(r.processes), boundary, cell(fla, ".3f"),
                         cell(rewy, ".3f"), f"{fla / rewy:.2f}x" if fla and rewy else "-",
                         f"{T / (rewy / 1e3):,.0f}" if rewy else "-",
                         " / ".join(cell(r.peak_mb.get(n), ".0f") for n in ("FLA", "rewy")),
                         " / ".join(cell(r.err.get(n), ".1e") for n in ("FLA", "rewy")),
                         "yes" if r.passed else "NO"])
    notes = sorted({f"{name}: {why}" for r in rows for name, why in r.errors.items()})
    checks = sorted({f"check T {r.check_T} for {r.shape}" for r in rows
                     if r.check_T != r.tokens_per_process * r.processes})
    return "\n".join(table(head, body, markdown=True) + [f"- {n}" for n in notes + checks])
