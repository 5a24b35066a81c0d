"""Op-level `rewy-hf bench`: one (op, policy, shape) configuration at a time: FLA 0.6.0's op (on CPU
the reference recurrence) against rewy's, each gradient-checked (KDA and GDN2 also on gates near the
safe lower bound, GDN also under strong decay) before it is timed; docs/bench.md gives the inputs,
the references and the pass rule."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import statistics
import time
import warnings
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import ops
from ..op_inputs import BOUND_OPS, DISPATCH_NAME, GRAD_NAMES, REWY_OPS, STRONG_OPS, Shape, make_inputs
from ..patching.fault import apply_grad_fault
from ..patching.reference_cores import fla_reference
from ..rel_error import rel_err
from .config import check_T
from . import fla_backends
from .rows import Check, OpRow, Timing
from .timing import Scope, describe, free_memory, leaves, measure, peak_mb, runner

# Pass rule. rewy may be at most 10 % less accurate than the baseline, plus a
# floor far below the rounding error of the dtype under test (BF16 gradients
# sit near 1e-3..1e-2 relative, float32 near 1e-6), so that two near-exact
# sides are not judged on noise. Where the baseline's gradients cannot be
# trusted or computed, rewy alone must stay within BF16-level error.
REL_MARGIN = 1.1
FLOOR = {"cuda": 1e-5, "cpu": 1e-4}
UNTRUSTED_TOL = 1e-2


@dataclass
class Settings:
    """How an op-level run times and checks (``device`` may name one GPU, cuda:N)."""
    device: str
    backend: str
    reps: int
    warmup: int
    rep_ms: float
    check_max_tokens: int
    seed: int
    gdn_guard: dict          # {"requested": bool, "was_active": bool | None}
    extra: Extra = field(default_factory=lambda: Extra())     # what a caller adds to the run

    @property
    def qkv_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32


@dataclass
class Impl:
    """One side under test: ``fn(*inputs) -> o``."""
    fn: Callable
    policy: str               # what it saves for backward, as far as it has a say
    trusted: bool = True      # may its gradients be compared
    note: str = ""
    scope: Scope = contextlib.nullcontext     # the context its forward and backward run in


class Extra:
    """What a caller adds to an op-level run (dev/bench_lab: further baselines, kernel profiles); this
    one adds nothing. ``settings``: entries for the run's settings."""
    settings: dict = {}

    def add_sides(self, ctx: ShapeContext, row: OpRow, sides: dict[str, tuple[Impl, Timing]]) -> None:
        """Before a checked row's timing: further sides into ``sides``, timed in the same rounds."""

    def after_row(self, row: OpRow, boundaries: list[str]) -> str:
        """After each row (timed, or stopped by its check): what the line printed for it adds."""
        return ""

    def tables(self, rows: list[OpRow], boundaries: list[str], base: str, device: str, markdown: bool) -> list[str]:
        """The tables that follow those of one (op, policy)."""
        return []


def baseline_label(device: str, versions: dict | None = None) -> str:
    """The baseline's name in tables; ``versions`` is the run's (FlashQLA installed changes what FLA runs)."""
    if device != "cuda":
        return "ref"
    return "FLA+QLA" if (versions or {}).get("flash-qla") else "FLA"


def baseline_description(device: str, versions: dict | None = None) -> str:
    if device == "cuda":
        if qla := (versions or {}).get("flash-qla"):
            return (f"FLA 0.6.0 (fla.ops chunk_* ops) with flash-qla {qla} installed: FLA runs GDN "
                    "(chunk_gated_delta_rule) through FlashQLA's TileLang kernels and, with tilelang and nvcc "
                    "present, KDA's fused backward (chunk_kda_bwd_wy_dqkg_fused) through TileLang, the rest "
                    "through its Triton kernels; each table says which backends served its op")
        return "FLA 0.6.0 (fla.ops chunk_* ops, Triton kernels)"
    return ("autograd through rewy's token-by-token reference recurrence (rewy_hf.kernels.reference, computes in "
            "float64): a CPU comparison against the reference path, NOT against FLA")


# --- the sides ----------------------------------------------------------------------------------

def rewy_impl(op: str, backend: str, policy: str, safe_gate: bool = False) -> Impl:
    f, name = REWY_OPS[op], DISPATCH_NAME[op]
    kw = {"safe_gate": True} if safe_gate else {}

    def fn(*x, **packing):
        o, _ = f(*x, backend=backend, policy=policy, **kw, **packing)
        apply_grad_fault(o, name)   # REWY_HF_TEST_FAULT: lets the tests prove that the check can fail
        return o

    return Impl(fn, policy)


# Where FLA 0.6.0 has each op: (module, function).
FLA_OPS = {"delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
           "gdn": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
           "kda": ("fla.ops.kda", "chunk_kda"), "gdn2": ("fla.ops.gdn2", "chunk_gdn2")}


def fla_function(op: str) -> Callable:
    module, name = FLA_OPS[op]
    return getattr(importlib.import_module(module), name)


def load_kernel_modules(ops) -> None:
    """Import FLA's op modules and rewy's Triton kernels for ``ops`` now rather than at their
    first call. An autotuner not yet imported when the bench forgets the picks would keep its
    on-disk result cache on, which can hold a pick made at another shape."""
    for op in ops:
        try:
            fla_function(op)
        except ImportError:     # no FLA: the rows say so when they run
            pass
    for name in ("scalar_gate.stages", "vector_gate.stages"):
        importlib.import_module(f"rewy_hf.kernels.triton_backend.{name}")
    from ..kernels.triton_backend import state_launch

    try:
        state_launch.relaunched_kernels()   # built lazily, as they wrap FLA's; they run where B x H is small
    except ImportError:
        pass


GUARD_NOTE = ("timing only: FLA's GDN backward guard was lifted (Hopper with triton < 3.7.1, FLA issue #640), so its "
              "gradients are not compared")


def fla_impl(op: str, policy: str, gdn_guard: dict, safe_gate: bool = False) -> Impl:
    """FLA's op, as installed."""
    f = fla_function(op)
    # FLA 0.6.0 has `disable_recompute` on chunk_kda and chunk_gdn2 only; its GDN
    # and DeltaNet ops always recompute, so that is what "full" times against there.
    if "disable_recompute" in inspect.signature(f).parameters:
        kw, fla_policy = {"disable_recompute": policy == "full"}, f"disable_recompute={policy == 'full'}"
    else:
        kw, fla_policy = {}, "recomputes (FLA's only mode for this op)"
    if safe_gate:
        kw["safe_gate"] = True
    impl = Impl(lambda *x, **packing: f(*x, **kw, **packing)[0], fla_policy)
    # FlashQLA or TileLang may serve the guarded kernel (gdn_guard_bypassed)
    if guard_lifted(op, gdn_guard) and not gdn_guard_bypassed():
        impl.trusted, impl.note = False, GUARD_NOTE
    return impl


def guard_lifted(op: str, gdn_guard: dict) -> bool:
    """Whether this is a GDN row whose FLA backward ran with FLA's #640 guard lifted."""
    return op == "gdn" and bool(gdn_guard.get("requested") and gdn_guard.get("was_active"))


def gdn_guard_bypassed() -> bool:
    """Whether FLA as installed runs GDN's backward without the kernel its guard is about: FlashQLA
    serves the whole op, or TileLang serves ``chunk_bwd_dqkwg`` (FLA turns that on for Hopper with
    triton >= 3.4 precisely for #640)."""
    on = fla_backends.active_backends()
    return "flash_qla" in on.get("gated_delta_rule", []) or "tilelang" in on.get("common", [])


def packed(impl: Impl | None, packing: dict) -> Impl | None:
    """``impl`` with the packing keyword (``cu_seqlens``) of a packed shape bound into its calls."""
    if impl is None or not packing:
        return impl
    return dataclasses.replace(impl, fn=lambda *x: impl.fn(*x, **packing))


def cpu_baseline_impl(op: str) -> Impl:
    ref = fla_reference(DISPATCH_NAME[op])
    return Impl(lambda *x, **packing: ref(*x, **packing)[0], "autograd keeps every intermediate")


def reference_grads(op: str, inputs, do, device: str, packing: dict | None = None) -> list[torch.Tensor]:
    packing = packing or {}
    if device == "cuda":
        f = REWY_OPS[op]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # "torch backend on GPU is slower": known here
            return grads(lambda *x: f(*x, backend="torch", policy="full", **packing)[0],
                         [x.float() for x in inputs], do.float())
    ref = fla_reference(DISPATCH_NAME[op])
    return grads(lambda *x: ref(*x, **packing)[0], [x.double() for x in inputs], do.double())


def lift_gdn_guard() -> dict:
    """Let FLA's GDN backward run where FLA 0.6.0 refuses it (Hopper, triton < 3.7.1)."""
    import fla.ops.common.chunk_o as chunk_o

    was_active = bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return {"requested": True, "was_active": was_active}


# --- correctness --------------------------------------------------------------------------------

def grads(fn: Callable, inputs, do, scope: Scope = contextlib.nullcontext) -> list[torch.Tensor]:
    xs = leaves(inputs)
    with scope():
        return list(torch.autograd.grad(fn(*xs), xs, do))


def served_grads(impl: Impl, inputs, do) -> tuple[list[torch.Tensor], list[str]]:
    """The gradients of one side, and which FLA backends served it (FLA's dispatch, recorded)."""
    with fla_backends.recording_served() as served:
        out = grads(impl.fn, inputs, do, impl.scope)
    return out, sorted(served)


def grad_errors(op: str, got, ref) -> dict[str, float]:
    return {n: rel_err(g, r) for n, g, r in zip(GRAD_NAMES[op], got, ref)}


def check(op: str, base: Impl | None, rewy: Impl, inputs, do, ref, device: str) -> Check:
    """Errors of both sides against ``ref`` and the verdict."""
    out = Check()
    try:
        per = grad_errors(op, grads(rewy.fn, inputs, do), ref)
        out.err_rewy, out.err_rewy_per_grad, out.rewy_backend = max(per.values()), per, ops.last_backend()
    except Exception as exc:   # a crash is a failed check, with its reason
        out.rewy_error, out.check_rule = describe(exc), "rewy must run"
        return out
    if base is not None and base.trusted:
        try:
            got, served = served_grads(base, inputs, do)
            per = grad_errors(op, got, ref)
            out.err_baseline, out.err_baseline_per_grad, out.baseline_served_by = max(per.values()), per, served
        except Exception as exc:
            out.baseline_check_error = describe(exc)
    err_r, err_b = out.err_rewy, out.err_baseline
    if err_b is not None and math.isfinite(err_b):
        floor = FLOOR[device]
        out.check_rule = f"err_rewy <= {REL_MARGIN} * err_baseline + {floor:g}"
        out.ok = bool(err_r <= REL_MARGIN * err_b + floor)
    else:
        out.check_rule = f"err_rewy < {UNTRUSTED_TOL:g} (baseline gradients not compared)"
        out.ok = bool(err_r < UNTRUSTED_TOL)
    return out


def second_checks(ctx: "ShapeContext", row: OpRow, base: Impl | None, rewy: Impl) -> None:
    """The lower-bound gate check of a KDA / GDN2 row (both sides with ``safe_gate=True``) and the
    strong-decay check of a GDN row; the row passes when every check does."""
    s, pack = ctx.s, ctx.check_packing
    if ctx.bound is not None:
        bound_base = None
        if base is not None:
            bound_base = fla_impl(ctx.op, row.policy, s.gdn_guard, safe_gate=True) if s.device == "cuda" else \
                cpu_baseline_impl(ctx.op)
        bound_rewy = rewy_impl(ctx.op, s.backend, row.policy, safe_gate=True)
        row.bound = check(ctx.op, packed(bound_base, pack), packed(bound_rewy, pack), *ctx.bound, s.device)
    if ctx.strong is not None:
        row.strong = check(ctx.op, packed(base, pack), packed(rewy, pack), *ctx.strong, s.device)
    row.ok = bool(row.ok and all(c.ok for _, c in row.second_checks()))


# --- one configuration --------------------------------------------------------------------------

class ShapeContext:
    """Inputs and reference gradients of one (op, shape), shared by its policies; for
    KDA / GDN2 also those of the lower-bound gate check (``bound``: inputs, do, reference), for GDN those
    of the strong-decay check (``strong``)."""

    def __init__(self, op: str, shape: Shape, s: Settings):
        self.op, self.shape, self.s = op, shape, s
        self.check_T = check_T(shape, s.check_max_tokens)
        check_shape = shape.with_T(self.check_T)
        self.check_inputs, self.check_do = make_inputs(op, check_shape, s.device, s.qkv_dtype, s.seed)
        self.check_packing = check_shape.packing(s.device)
        self.ref = reference_grads(op, self.check_inputs, self.check_do, s.device, self.check_packing)
        self.bound = self.strong = None
        for gates, checked, seed in (("bound", BOUND_OPS, s.seed + 2), ("strong", STRONG_OPS, s.seed + 3)):
            if op in checked:
                inputs, do = make_inputs(op, check_shape, s.device, s.qkv_dtype, seed, gates=gates)
                setattr(self, gates, (inputs, do, reference_grads(op, inputs, do, s.device, self.check_packing)))

    def timed_inputs(self):
        if self.check_T == self.shape.T:
            return self.check_inputs, self.check_do
        return make_inputs(self.op, self.shape, self.s.device, self.s.qkv_dtype, self.s.seed + 1)


def time_sides(sides: dict[str, tuple[Impl, Timing]], boundary: str, inputs, do, s: Settings) -> None:
    """Each side's rounds at ``boundary`` into its Timing (None and no rounds where it failed)."""
    runners = {}
    for name, (impl, timing) in sides.items():
        try:
            runners[name] = runner(boundary, impl.fn, inputs, do, impl.scope)
        except Exception as exc:
            timing.fail(describe(exc))
    samples, errors = measure(runners, s.device, s.warmup, s.reps, s.rep_ms)
    for name, (_, timing) in sides.items():
        ms = samples.get(name)
        timing.ms[boundary], timing.rounds[boundary] = (statistics.median(ms) if ms else None), ms or []
        if name in errors:
            timing.fail(errors[name])


def run_config(ctx: ShapeContext, policy: str, boundaries: list[str]) -> OpRow:
    op, shape, s = ctx.op, ctx.shape, ctx.s
    t_start = time.perf_counter()
    row = OpRow(op, policy, shape, check_T=ctx.check_T, check_reduced=ctx.check_T != shape.T)
    rewy = rewy_impl(op, s.backend, policy)
    base: Impl | None
    try:
        base = fla_impl(op, policy, s.gdn_guard) if s.device == "cuda" else cpu_baseline_impl(op)
        row.baseline_policy, row.baseline_timing_only, row.baseline_note = base.policy, not base.trusted, base.note
    except Exception as exc:   # e.g. FLA missing an op: rewy is still checked against the reference
        base = None
        row.baseline.fail(describe(exc))
    row.check = check(op, packed(base, ctx.check_packing), packed(rewy, ctx.check_packing), ctx.check_inputs,
                      ctx.check_do, ctx.ref, s.device)
    row.ok = row.check.ok
    if row.check.rewy_error:
        row.rewy.fail(row.check.rewy_error)
    else:
        second_checks(ctx, row, base, rewy)
    if row.rewy.error:
        row.seconds = round(time.perf_counter() - t_start, 2)
        return row
    timed_packing = shape.packing(s.device)
    sides = {name: (packed(impl, timed_packing), timing) for name, impl, timing in
             [("baseline", base, row.baseline), ("rewy", rewy, row.rewy)] if impl is not None}
    s.extra.add_sides(ctx, row, sides)
    inputs, do = ctx.timed_inputs()
    for boundary in boundaries:
        time_sides(sides, boundary, inputs, do, s)
        b, r = row.baseline.ms.setdefault(boundary, None), row.rewy.ms[boundary]
        row.baseline.rounds.setdefault(boundary, [])
        row.speedup[boundary] = b / r if b and r else None
        free_memory(s.device)
    if s.device == "cuda":
        # After the timing: first calls at a new shape autotune, and Triton's
        # autotuner allocates an L2-flush buffer that would count as peak memory.
        for impl, timing in sides.values():
            try:
                timing.peak_mb = peak_mb(impl.fn, inputs, do, impl.scope)
            except Exception as exc:
                timing.fail(describe(exc))
            free_memory(s.device)
    if row.rewy.error:
        row.ok = False
    if op == "gdn" and "#640" in (row.baseline.error or row.check.baseline_check_error or ""):
        row.baseline_hint = ("FLA refuses its GDN backward here (Hopper, triton < 3.7.1); rerun with "
                             "--lift-gdn-guard to time it (timing only)")
    row.seconds = round(time.perf_counter() - t_start, 2)
    return row
