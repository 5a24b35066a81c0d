"""The checks of `rewy-hf verify`, in three groups, each check a row of its table.

``env``: the FLA pin, the FLA import and (on CUDA) the device. ``ops``: every
op's forward and backward against the float64 recurrence on small shapes and,
on CUDA, the Triton backend against the fp32 torch backend. ``models``: every
adapter family on its tiny preset, one parity step.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

GROUPS = ("env", "ops", "models")
PRESETS = ("tiny-qwen3.5", "tiny-kimi-linear", "tiny-fla-deltanet", "tiny-fla-gdn", "tiny-fla-kda", "tiny-fla-gdn2")

Check = tuple[str, bool, str]     # name, ok, detail


def env_checks(device: str) -> Iterator[Check]:
    from ..environment import collect_env

    env = collect_env()
    yield "FLA version pin", env["fla_pin"]["ok"], env["fla_pin"]["message"]
    fla = env["fla_import"] or {"ok": False, "error": "not imported"}
    yield "FLA import", fla["ok"], fla["error"] or "ok"
    if device == "cuda":
        yield "CUDA device", env["cuda"]["available"], str(env["cuda"].get("devices") or "none found")


def op_checks(device: str) -> Iterator[Check]:
    import torch

    from .. import ops
    from .op_checks import FLOAT64_TOL, reference_error, triton_checks

    gen = torch.Generator().manual_seed(0)
    for op in ops.__all__:
        worst, _ = reference_error(op, gen, device=device)
        yield (f"{op} torch backend vs float64", worst <= FLOAT64_TOL,
               f"worst rel. error {worst:.1e} (tol {FLOAT64_TOL:g})")
    if device == "cuda":
        yield from triton_checks()


def model_checks(device: str) -> Iterator[Check]:
    import torch

    from ..models import loading
    from ..parity.comparison import DEFAULT_TOLERANCES, run_parity

    # The adapter check: rewy's torch backend in the patched model against the
    # float64 reference cores in the unpatched one, on every device. The
    # models' own cores are not the reference here: FLA 0.6.0 refuses its GDN
    # backward on Hopper with triton < 3.7.1, and its fp32 kernels round
    # through tf32. The Triton backend is checked op by op in the "ops" group.
    for preset in PRESETS:
        try:
            model = loading.load_causal_lm(preset, device=device).model
            batch = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
            result = run_parity(model, [batch], tolerance=DEFAULT_TOLERANCES[torch.float32], check_update=False,
                                backend="torch", reference_cores=True)
        except Exception as exc:  # one preset's crash is its own failed row; the others still run
            yield f"{preset} parity", False, f"{type(exc).__name__}: {exc}"
            continue
        worst = max((p.rel_err for p in result.params), default=0.0)
        detail = (f"loss rel {result.loss_rel_err:.1e}, worst grad rel {worst:.1e}, "
                  f"{result.optimized_backward_calls} optimized backward call(s); torch backend vs reference cores")
        yield f"{preset} parity", result.ok, detail


CHECKS: dict[str, Callable[[str], Iterator[Check]]] = {"env": env_checks, "ops": op_checks, "models": model_checks}


def run_checks(groups: list[str], device: str, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Every check of ``groups`` as a row {group, check, ok, detail, seconds}; ``on_row`` sees each
    row as it is done. A check that crashes is a failed row with its reason, and ends its group."""
    rows = []
    for group in groups:
        it = CHECKS[group](device)
        while True:
            t0 = time.perf_counter()
            try:
                name, ok, detail = next(it)
            except StopIteration:
                break
            except Exception as exc:
                row = {"group": group, "check": f"{group} (crashed)", "ok": False,
                       "detail": f"{type(exc).__name__}: {exc}", "seconds": 0.0}
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                break
            row = {"group": group, "check": name, "ok": bool(ok), "detail": detail,
                   "seconds": round(time.perf_counter() - t0, 2)}
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
