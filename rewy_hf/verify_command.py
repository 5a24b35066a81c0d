"""`rewy-hf verify`: a short self-check of a fresh install.

Three groups of checks, each a row of the table: the environment (FLA pin,
FLA import, device), every op's forward and backward against the float64
recurrence on small shapes (and, on CUDA, the Triton backend against the fp32
torch backend), and every adapter family on its tiny preset (one parity step).
Exit code 0 when every row passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

HELP = "self-check of a fresh install: environment, each op, each adapter family (exit 0 = all pass)"

PRESETS = ("tiny-qwen3.5", "tiny-kimi-linear", "tiny-fla-deltanet", "tiny-fla-gdn", "tiny-fla-kda", "tiny-fla-gdn2")
GROUPS = ("env", "ops", "models")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--only", choices=GROUPS, action="append", help="run only these groups (repeatable)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the table as JSON")


def _env_checks(device: str):
    from .env import collect_env

    env = collect_env()
    yield "FLA version pin", env["fla_pin"]["ok"], env["fla_pin"]["message"]
    fla = env["fla_import"] or {"ok": False, "error": "not imported"}
    yield "FLA import", fla["ok"], fla["error"] or "ok"
    if device == "cuda":
        yield "CUDA device", env["cuda"]["available"], str(env["cuda"].get("devices") or "none found")


def _op_checks(device: str):
    import torch

    from . import demo

    gen = torch.Generator().manual_seed(0)
    for op in demo.ops.__all__:
        worst, _ = demo.run_op(op, gen, device=device)
        yield f"{op} torch backend vs float64", worst <= demo.TOL, f"worst rel. error {worst:.1e} (tol {demo.TOL:g})"
    if device == "cuda":
        from .verify_triton import triton_checks

        yield from triton_checks()


def _model_checks(device: str):
    import torch

    from .model_loading import load_causal_lm
    from .parity import DEFAULT_TOLERANCES, run_parity

    # The adapter check: rewy's torch backend in the patched model against the
    # float64 reference cores in the unpatched one, on every device. The
    # models' own cores are not the reference here: FLA 0.6.0 refuses its GDN
    # backward on Hopper with triton < 3.7.1, and its fp32 kernels round
    # through tf32. The Triton backend is checked op by op in the "ops" group.
    for preset in PRESETS:
        try:
            model = load_causal_lm(preset, device=device).model
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


def run(args: argparse.Namespace) -> int:
    import torch

    from .cpu_triton import enable_cpu_interpreter, first_config_only

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        enable_cpu_interpreter()
    elif "fla" not in sys.modules:
        first_config_only()
    groups = args.only or list(GROUPS)
    checks = {"env": _env_checks, "ops": _op_checks, "models": _model_checks}
    rows = []
    for group in groups:
        it = checks[group](device)
        while True:
            t0 = time.perf_counter()
            try:
                name, ok, detail = next(it)
            except StopIteration:
                break
            except Exception as exc:  # a check that crashes is a failed check, with its reason
                name, ok, detail = f"{group} (crashed)", False, f"{type(exc).__name__}: {exc}"
                rows.append({"group": group, "check": name, "ok": ok, "detail": detail, "seconds": 0.0})
                print(f"FAIL  {name:<50} {detail}", flush=True)
                break
            rows.append({"group": group, "check": name, "ok": bool(ok), "detail": detail,
                         "seconds": round(time.perf_counter() - t0, 2)})
            print(f"{'PASS' if ok else 'FAIL'}  {name:<50} {detail}", flush=True)
    failed = [r for r in rows if not r["ok"]]
    print(f"\nrewy-hf verify on {device}: {len(rows) - len(failed)} of {len(rows)} checks passed"
          + (f"; failed: {', '.join(r['check'] for r in failed)}" if failed else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "ok": not failed, "checks": rows}, f, indent=2)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(device=None, only=None, json=None)))
