"""A whole op-level run: ``describe_run`` builds its JSON document before any row, ``run_rows`` adds
one row per (op, shape, policy), ``conclude`` the geometric means and the verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..op_inputs import Shape
from . import fla_backends
from .autotune_picks import forget_picks
from .config import BOUND_CHECK, STRONG_CHECK, environment
from .op_bench import Settings, ShapeContext, baseline_description, load_kernel_modules, run_config
from .rows import OpRow, Timing
from .tables import geomeans
from .timing import free_memory


@dataclass
class OpRun:
    ops: list[str]
    policies: list[str]
    boundaries: list[str]
    shapes: list[Shape]
    shapes_origin: str
    settings: Settings
    keep_autotune_picks: bool

    @property
    def cuda(self) -> bool:
        return self.settings.device == "cuda"


def describe_run(run: OpRun) -> dict:
    s, cuda = run.settings, run.cuda
    env = environment(s.device)
    timing = (f"median of {s.reps} alternating rounds after {s.warmup} warm-up run(s) per side; each round one "
              f"triton.testing.do_bench median over {s.rep_ms:g} ms of runs" if cuda else
              f"median of {s.reps} alternating time.perf_counter runs after {s.warmup} warm-up run(s) per side")
    autotune = ("Triton autotune picks (FLA's and rewy's) kept from shape to shape" if run.keep_autotune_picks
                else "Triton autotune picks (FLA's and rewy's) forgotten before each shape, so each shape runs "
                     "the configs tuned at it")
    check = ("input gradients vs " + ("rewy's torch backend (policy full) on the same BF16 values in float32"
                                      if cuda else "the float64 reference recurrence on the same values")
             + "; relative Frobenius error, worst over the gradients; " + BOUND_CHECK + "; " + STRONG_CHECK)
    dtype = str(s.qkv_dtype).removeprefix("torch.")
    return {"kind": "ops", **env, "baseline": baseline_description(s.device, env["versions"]), "settings": {
        "ops": run.ops, "policies": run.policies, "boundaries": run.boundaries, "backend": s.backend,
        "shapes": [sh.__dict__ for sh in run.shapes], "shapes_origin": run.shapes_origin,
        "qkv_dtype": dtype, "gates_dtype": "float32", "beta_b_w_dtype": dtype,
        "reps": s.reps, "warmup": s.warmup, "rep_ms": s.rep_ms if cuda else None, "timing": timing,
        "autotune": autotune if cuda else None,
        "check": check, "check_max_tokens": s.check_max_tokens, "gdn_guard": s.gdn_guard, "seed": s.seed,
        **s.extra.settings},
        "fla_backends_on": fla_backends.active_backends() if cuda else {},
        "rows": [], "complete": False}


def run_rows(run: OpRun, data: dict, *, save: Callable[[dict], None], on_row: Callable[[OpRow], None],
             step: Callable[[str], None]) -> None:
    """Append one row per configuration to ``data["rows"]``, calling ``save(data)`` after each, so a
    run killed half way still leaves its rows; ``on_row(row)`` (before that save) and ``step(label)``
    report progress."""
    rows = data["rows"]
    tune_per_shape = run.cuda and not run.keep_autotune_picks
    if tune_per_shape:
        load_kernel_modules(run.ops)    # so that forget_picks sees every autotuner from the first shape on
    for op in run.ops:
        for shape in run.shapes:
            if tune_per_shape:
                forget_picks()
            try:
                ctx = ShapeContext(op, shape, run.settings)
            except Exception as exc:   # the reference itself failed (e.g. out of memory): say where
                for policy in run.policies:
                    rows.append(OpRow(op, policy, shape, rewy=Timing(
                        error=f"reference failed: {type(exc).__name__}: {exc}")))
                    step(f"{op} {shape.label} {policy}: reference failed")
                save(data)
                continue
            for policy in run.policies:
                row = run_config(ctx, policy, run.boundaries)
                rows.append(row)
                on_row(row)
                step(f"{op} {shape.label} {policy}")
                save(data)
            del ctx
            free_memory(run.settings.device)


def conclude(data: dict) -> list[OpRow]:
    """Add the geometric means and the verdict to a finished run's ``data``; returns the failed rows."""
    rows = data["rows"]
    data["geomean"] = geomeans(rows, data["settings"]["boundaries"])
    failed = [r for r in rows if not r.ok]
    data.update(ok=not failed, exit_code=1 if failed else 0, complete=True)
    return failed
