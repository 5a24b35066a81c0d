"""Loss and gradient parity of a patched model against its unpatched self.

The model is copied before patching, so both sides start from the same weights
(and, with LoRA, the same adapter weights). Each step feeds both the same
batch, runs forward + backward, and compares the loss and every trainable
parameter's gradient (relative error ||x - ref|| / ||ref|| and cosine
similarity). The unpatched side runs its original core; where that cannot run
(CPU with FLA installed, FLA-hub layers on CPU) it runs the reference core of
``rewy_hf.patching.reference_cores``. Optionally one optimizer step is taken
on both sides and the parameter updates are compared too.

With ``compile_backend`` both sides run through ``torch.compile`` (the unpatched one
keeping the installed kernels with their graph breaks, installed_kernels.py),
so the comparison is rewy's core against the model's own under compilation;
set beside an eager comparison it tells what patching changes from what
compiling changes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch
import torch.nn as nn

from ..installed_kernels import installed_kernels_under_compile
from ..patching.dispatch import dispatch_report, reset_dispatch_report
from ..patching.patch import patch_model, unpatch_model
from ..patching.reference_cores import use_reference_cores


class OriginalCoreError(RuntimeError):
    """The unpatched side failed while it ran the model's own delta-rule cores (not the
    reference cores), e.g. FLA refusing its GDN backward on some GPUs; ``__cause__`` is
    the exception it raised. Running the reference cores there instead may get past it."""


@contextlib.contextmanager
def original_core_errors(use_reference: bool):
    """Re-raise what the unpatched model's own cores raise as ``OriginalCoreError`` (out-of-memory as
    it is); where rewy's reference cores stand in for them, their errors are rewy's and pass as they are."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        if use_reference:
            raise
        raise OriginalCoreError(f"{type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class Tolerance:
    loss_rel: float
    grad_rel: float
    min_cosine: float


# float32: both sides accumulate in fp32 but in different orders; gradients of
# gate parameters (A_log, dt_bias) sum many cancelling per-token terms and sit
# near 1e-4 relative even between two correct fp32 implementations.
# bfloat16: activations round to 8 mantissa bits on both sides.
DEFAULT_TOLERANCES = {
    torch.float64: Tolerance(loss_rel=1e-9, grad_rel=1e-7, min_cosine=1 - 1e-12),
    torch.float32: Tolerance(loss_rel=1e-5, grad_rel=1e-3, min_cosine=1 - 1e-6),
    torch.bfloat16: Tolerance(loss_rel=2e-2, grad_rel=1e-1, min_cosine=0.99),
    torch.float16: Tolerance(loss_rel=1e-2, grad_rel=5e-2, min_cosine=0.995),
}


@dataclass
class ParamResult:
    name: str
    group: str
    numel: int
    rel_err: float
    cosine: float
    ok: bool
    tiny: bool = False     # judged against the tiny-gradient floor, see compare()
    raw_rel_err: float | None = None   # update rows: the error before the weights' rounding is taken off


@dataclass
class ParityResult:
    tolerance: Tolerance
    losses: list[tuple[float, float]] = field(default_factory=list)        # (unpatched, patched) per step
    grad_norms: list[tuple[float, float]] = field(default_factory=list)    # global L2 norm, (unpatched, patched) per step
    params: list[ParamResult] = field(default_factory=list)               # worst over steps
    update: list[ParamResult] = field(default_factory=list)               # optimizer-step comparison
    backward_ms: dict[str, list[float]] = field(default_factory=lambda: {"unpatched": [], "patched": []})
    patch_report: dict | None = None
    dispatch: dict | None = None
    compile_backend: str | None = None     # the torch.compile backend both sides ran under, or None: eager

    @property
    def loss_rel_err(self) -> float:
        return max((abs(p - u) / max(abs(u), 1e-30) for u, p in self.losses), default=0.0)

    @property
    def optimized_backward_calls(self) -> int:
        ops = (self.dispatch or {}).get("ops", {})
        return sum(e["optimized_backward_calls"] for e in ops.values())

    @property
    def ok(self) -> bool:
        return (self.loss_rel_err <= self.tolerance.loss_rel and all(p.ok for p in self.params)
                and all(p.ok for p in self.update) and self.optimized_backward_calls > 0)

    def failing(self) -> list[ParamResult]:
        return [p for p in self.params + self.update if not p.ok]

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "compile": self.compile_backend,
            "tolerance": asdict(self.tolerance),
            "loss": [{"unpatched": u, "patched": p, "abs_diff": abs(p - u),
                      "rel_diff": abs(p - u) / max(abs(u), 1e-30)} for u, p in self.losses],
            "loss_rel_err": self.loss_rel_err,
            # The global norm is what a training run's gradient clipping and its logs see.
            "grad_norm": [{"unpatched": u, "patched": p, "rel_diff": abs(p - u) / max(u, 1e-30)}
                          for u, p in self.grad_norms],
            "gradients": [asdict(p) for p in self.params],
            "update": [asdict(p) for p in self.update],
            "groups": group_summary(self.params),
            "backward_ms": {k: _median(v) for k, v in self.backward_ms.items()},
            "backward_speedup": _ratio(self.backward_ms),
            "optimized_backward_calls": self.optimized_backward_calls,
            "patch_report": self.patch_report,
            "dispatch": self.dispatch,
        }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(ms: dict[str, list[float]]) -> float | None:
    u, p = _median(ms["unpatched"]), _median(ms["patched"])
    return None if not u or not p else u / p


_GROUP = re.compile(r"^(.*?\blayers\.\d+)\.")


def param_group(name: str) -> str:
    """``model.layers.3.linear_attn.A_log`` -> ``model.layers.3``; others by first component."""
    m = _GROUP.match(name)
    return m.group(1) if m else name.split(".")[0]


# A gradient smaller than this fraction of the largest one is judged against
# that floor instead of its own norm: freshly initialised gate parameters can
# have gradients of 1e-9 next to 1e-1 elsewhere, where two correct float32
# implementations already disagree by 100 % relative, and where no update a
# training run takes could tell them apart.
TINY_GRADIENT = 1e-4


def compare(name: str, x: torch.Tensor, ref: torch.Tensor, tol: Tolerance, floor: float = 0.0) -> ParamResult:
    x, ref = x.detach().double().flatten(), ref.detach().double().flatten()
    ref_norm, x_norm = ref.norm().item(), x.norm().item()
    diff = (x - ref).norm().item()
    if ref_norm == 0.0:
        rel = 0.0 if diff == 0.0 else math.inf
    else:
        rel = diff / ref_norm
    cosine = 1.0 if ref_norm == 0.0 and x_norm == 0.0 else (
        (x @ ref).item() / (x_norm * ref_norm) if x_norm and ref_norm else 0.0)
    if math.isnan(rel) or math.isnan(cosine) or math.isnan(diff):
        return ParamResult(name, param_group(name), x.numel(), math.inf, -1.0, False)
    tiny = ref_norm < floor
    ok = diff <= tol.grad_rel * max(ref_norm, floor) and (tiny or cosine >= tol.min_cosine or rel <= tol.grad_rel * 1e-3)
    return ParamResult(name, param_group(name), x.numel(), rel, cosine, ok, tiny)


def global_norm(grads: dict[str, torch.Tensor]) -> float:
    """The L2 norm over all gradients together, accumulated in float64."""
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))


def group_summary(params: list[ParamResult]) -> list[dict]:
    groups: dict[str, list[ParamResult]] = {}
    for p in params:
        groups.setdefault(p.group, []).append(p)
    out = []
    for name, ps in groups.items():
        worst = max(ps, key=lambda p: p.rel_err)
        out.append({"group": name, "params": len(ps), "max_rel_err": worst.rel_err,
                    "min_cosine": min(p.cosine for p in ps), "worst_param": worst.name,
                    "ok": all(p.ok for p in ps)})
    return out


def _loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=input_ids, labels=input_ids)
    return out.loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: nn.Module, input_ids: torch.Tensor, reference: bool,
          forward: nn.Module | None = None) -> tuple[float, float, dict]:
    """One forward + backward of ``model`` (through ``forward``, its compiled form, where given)."""
    model.zero_grad(set_to_none=True)
    ctx = use_reference_cores(model) if reference else contextlib.nullcontext()
    with ctx:
        loss = _loss(model if forward is None else forward, input_ids)
        _sync(input_ids.device)
        t0 = time.perf_counter()
        loss.backward()
        _sync(input_ids.device)
        ms = (time.perf_counter() - t0) * 1e3
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.item(), ms, grads


def run_parity(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    tolerance: Tolerance,
    backend: str = "auto",
    policy: str = "recompute",
    check_update: bool = True,
    reference_cores: bool | None = None,
    progress=None,
    compile_backend: str | None = None,
) -> ParityResult:
    """Compare ``model`` patched vs unpatched on ``batches`` of token ids.

    ``model`` itself becomes the patched side; an unpatched deep copy is the
    reference. ``reference_cores`` makes the unpatched side run the reference
    cores instead of its original ones (default: on CPU only, where the
    originals cannot run); where the originals run and fail, ``OriginalCoreError``
    is raised. ``compile_backend`` (a ``torch.compile`` backend name, e.g. "inductor")
    runs both sides compiled. ``progress`` is an optional callable(step).
    """
    reference_model = copy.deepcopy(model)
    unpatch_model(reference_model)          # in case the caller had patched it already
    device = next(model.parameters()).device
    use_reference = device.type != "cuda" if reference_cores is None else reference_cores
    result = ParityResult(tolerance=tolerance, compile_backend=compile_backend)
    result.patch_report = patch_model(model, backend=backend, policy=policy).to_dict()
    compiled = {} if compile_backend is None else {
        "unpatched": torch.compile(reference_model, backend=compile_backend),
        "patched": torch.compile(model, backend=compile_backend)}

    def unpatched_scope():
        # Traced with the installed kernels, as a user's compiled unpatched model runs on any torch.
        return installed_kernels_under_compile() if compile_backend is not None else contextlib.nullcontext()

    reset_dispatch_report()
    worst: dict[str, ParamResult] = {}
    last_grads = None
    for step, input_ids in enumerate(batches):
        input_ids = input_ids.to(device)
        with original_core_errors(use_reference), unpatched_scope():
            loss_u, ms_u, grads_u = _step(reference_model, input_ids, reference=use_reference,
                                          forward=compiled.get("unpatched"))
        loss_p, ms_p, grads_p = _step(model, input_ids, reference=False, forward=compiled.get("patched"))
        result.losses.append((loss_u, loss_p))
        result.grad_norms.append((global_norm(grads_u), global_norm(grads_p)))
        result.backward_ms["unpatched"].append(ms_u)
        result.backward_ms["patched"].append(ms_p)
        floor = TINY_GRADIENT * max((g.double().norm().item() for g in grads_u.values()), default=0.0)
        for name, g_ref in grads_u.items():
            g = grads_p.get(name)
            r = compare(name, g if g is not None else torch.zeros_like(g_ref), g_ref, tolerance, floor)
            if name not in worst or r.rel_err > worst[name].rel_err:
                worst[name] = r
        last_grads = (grads_u, grads_p)
        if progress is not None:
            progress(step)
    result.params = list(worst.values())
    result.dispatch = dispatch_report()
    if check_update and last_grads is not None:
        result.update = _compare_update(reference_model, model, tolerance)
    return result


def _compare_update(reference_model: nn.Module, model: nn.Module, tol: Tolerance) -> list[ParamResult]:
    """One SGD step from each side's last gradients: the updates must agree too (``compare_update``)."""
    updates, after = [], []
    for side in (reference_model, model):
        before = {n: p.detach().clone() for n, p in side.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD([p for p in side.parameters() if p.requires_grad], lr=1e-2)
        opt.step()
        after.append({n: side.get_parameter(n).detach() for n in before})
        updates.append({n: after[-1][n].double() - before[n].double() for n in before})
    floor = TINY_GRADIENT * max((u.norm().item() for u in updates[0].values()), default=0.0)
    return [compare_update(f"update:{n}", updates[1][n], ref, after[1][n], after[0][n], tol, floor)
            for n, ref in updates[0].items()]


def compare_update(name: str, update: torch.Tensor, ref: torch.Tensor, updated: torch.Tensor,
                   ref_updated: torch.Tensor, tol: Tolerance, floor: float = 0.0) -> ParamResult:
    """``compare`` of a parameter's update against the reference side's, beyond the rounding of the
    updated weights (``updated``, ``ref_updated``, in the parameter's dtype) to that dtype.

    A step of lr * g is far below a weight's own size, so in bfloat16 it is a few units in the last
    place (ulp) of the weight: two sides whose gradients agree to 1e-3 still round a weight now and then
    to neighbouring values, one ulp apart, which alone can be 10 % of a small update. Each element's
    difference is therefore judged less the one rounding step it may take (the ulp of the larger of the
    two updated weights): what is left is at most lr times the gradients' difference, and must be within
    the gradient tolerance of the update. In float32 that step is about 1e-7 of the weight and changes
    nothing. ``raw_rel_err`` keeps the error before that step is taken off."""
    diff = update.double() - ref.double()
    step = torch.maximum(rounding_step(updated), rounding_step(ref_updated))
    beyond = diff.sign() * (diff.abs() - step).clamp_min(0.0)
    result = compare(name, ref + beyond, ref, tol, floor)
    result.raw_rel_err = compare(name, update, ref, tol, floor).rel_err
    return result


def rounding_step(x: torch.Tensor) -> torch.Tensor:
    """Per element, the distance (float64) from ``|x|`` to the next larger value of ``x``'s dtype: how far
    apart two roundings of nearly the same number to that dtype can land."""
    mag = x.detach().abs()
    return (torch.nextafter(mag, torch.full_like(mag, math.inf)) - mag).double()
