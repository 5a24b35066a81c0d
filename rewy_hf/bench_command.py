"""`rewy-hf bench`: speed and correctness evidence you can rerun on your own machine.

Op level (default): FLA 0.6.0's op against rewy's, in one process, alternating,
median of repeated rounds after warm-up, for the boundaries B (backward only,
given the saved forward graph) and FB (forward + backward), plus peak memory
and a gradient check of every timed configuration against a higher-precision
reference. On CPU the baseline is autograd through rewy's reference
recurrence instead of FLA, and the output says so.

Model level (``--model``): one whole training step (forward + loss backward +
AdamW step + zero_grad), the same model instance unpatched and patched.

Exit codes: 0 every check passed; 1 a check failed (a gradient error over its
bound or a rewy crash; at model level: no layer patched, no optimized backward
ran, or a non-finite loss); 2 could not run (bad options, no CUDA, --plot
without matplotlib, a model that cannot be loaded, patched or stepped).
"""

from __future__ import annotations

import argparse
import sys
import warnings

HELP = "time FLA vs rewy per op (with a gradient check of every configuration), or a whole model's training step"

_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# Defaults that depend on the device: (cuda, cpu).
_OP_REPS, _OP_WARMUP = (5, 3), (3, 1)
_MODEL_STEPS, _MODEL_WARMUP, _MODEL_SEQ = (10, 2), (2, 1), (4096, 128)


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {minimum}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench_config import BOUNDARIES, OPS, POLICIES, parse_shape

    parser.add_argument("--model", default=None, metavar="SPEC",
                        help="model-level bench of this hub id, local directory or preset (qwen3.5-1b, gdn2-1b, "
                             "tiny-qwen3.5, tiny-fla-gdn2, ...); without it the op-level bench runs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if available, else cpu (CPU compares against the reference path, not FLA)")
    parser.add_argument("--policy", nargs="+", action="extend", choices=(*POLICIES, "both"), default=None,
                        help="what rewy's forward saves for backward; op level default: both; model level: one "
                             "(default recompute)")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                        help="rewy's backend (default auto: triton on CUDA where rewy has kernels, else torch)")
    parser.add_argument("--warmup", type=_count(0), default=None,
                        help="untimed runs per side first (op default: 3 on CUDA, 1 on CPU; model: 2 / 1 steps)")
    parser.add_argument("--lift-gdn-guard", action="store_true",
                        help="let FLA 0.6.0 run its GDN backward on Hopper with triton < 3.7.1 (which it refuses, FLA "
                             "#640) so it can be timed; that baseline is marked timing only and its gradients are "
                             "never compared")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="write settings, versions and every row")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="bar chart of the speedups (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", default=None, metavar="OUT.md",
                        help="also write the tables as Markdown (for docs/performance.md); works with --from-json")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="RUN.json",
                        help="run nothing: print the tables of an earlier run's --json (and draw --plot from it), "
                             "e.g. on a machine with matplotlib after a GPU run without it; exits with its status. "
                             "Several op-level files of one setup are combined into one report")

    ops = parser.add_argument_group("op level")
    ops.add_argument("--op", nargs="+", action="extend", choices=(*OPS, "all"), default=None,
                     help="ops to run (default: all)")
    ops.add_argument("--boundary", nargs="+", action="extend", choices=(*BOUNDARIES, "both"), default=None,
                     help="B = backward only (forward graph built outside the timing), FB = forward + backward "
                          "(default: both)")
    ops.add_argument("--shapes", nargs="+", action="extend", type=parse_shape, default=None, metavar="SHAPE",
                     help="'suite' (default: the six-shape GPU suite; on CPU one small shape) or B,T,H[,K,V] "
                          "(K = V = 128 on CUDA, 64 on CPU when left out); repeatable")
    ops.add_argument("--reps", type=_count(1), default=None,
                     help="timed rounds per side, alternating (default 5 on CUDA, 3 on CPU); the median is "
                          "reported. On CUDA each round is one triton do_bench median over --rep-ms")
    ops.add_argument("--keep-autotune-picks", action="store_true",
                     help="CUDA: keep Triton's autotune picks from one shape to the next (default: forget them "
                          "before each shape, so each is timed with the configs tuned at it, as a run at that "
                          "shape alone would be; FLA's keys leave out B and T)")
    ops.add_argument("--rep-ms", type=float, default=50.0, help="CUDA: milliseconds of runs per round (default 50)")
    ops.add_argument("--check-max-tokens", type=_count(64), default=2**19, metavar="N",
                     help="shapes with B*T*H above N are gradient-checked at a reduced T (same B, H; said in the "
                          "output) to save time and memory (default 524288)")

    model = parser.add_argument_group("model level (--model)")
    model.add_argument("--seq-len", type=_count(1), default=None, help="tokens per sequence (default 4096 on CUDA, "
                                                                       "128 on CPU)")
    model.add_argument("--batch-size", type=_count(1), default=1)
    model.add_argument("--steps", type=_count(1), default=None,
                       help="timed steps per side (default 10 on CUDA, 2 on CPU)")
    model.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                       help="model dtype (default bf16 on CUDA, fp32 on CPU)")
    model.add_argument("--revision", default=None, help="hub revision")
    model.add_argument("--trust-remote-code", action="store_true")


def _could_not_run(message: str) -> int:
    print(f"rewy-hf bench: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import torch

    from .bench_output import plot_unavailable
    from .cpu_triton import enable_cpu_interpreter

    if args.from_json:
        return _render(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        return _could_not_run("--device cuda, but torch sees no CUDA device; use --device cpu (a comparison "
                              "against the reference path) or a CUDA build of torch")
    if args.plot and (reason := plot_unavailable()):
        return _could_not_run(reason)
    if device == "cpu":
        enable_cpu_interpreter()
    guard = {"requested": bool(args.lift_gdn_guard), "was_active": None}
    if args.lift_gdn_guard and device == "cuda":
        from .bench_ops import lift_gdn_guard

        guard = lift_gdn_guard()
    with warnings.catch_warnings():
        # Each row names the backend that served it; the once-per-op warning adds nothing here.
        warnings.filterwarnings("ignore", message=r"rewy-hf: .* runs on the torch backend on GPU")
        if args.model:
            from .bench_model_command import run_model

            return run_model(args, device, guard)
        return _run_ops(args, device, guard)


def _run_ops(args, device: str, guard: dict) -> int:
    from .bench_config import BOUND_CHECK, BOUNDARIES, OPS, POLICIES, expand, resolve_shapes
    from .autotune_picks import forget_picks
    from .bench_ops import (Settings, ShapeContext, baseline_description, baseline_label,
                            free_memory, load_kernel_modules, run_config)
    from .bench_output import (environment, format_op_tables, format_row_line, geomeans, plot_op_speedups,
                               progress, writer)

    cuda = device == "cuda"
    ops = expand(args.op, OPS, "all", OPS)
    policies = expand(args.policy, POLICIES, "both", POLICIES)
    boundaries = expand(args.boundary, BOUNDARIES, "both", BOUNDARIES)
    shapes, origin = resolve_shapes(args.shapes, device)
    s = Settings(device=device, backend=args.backend, reps=args.reps or _OP_REPS[not cuda],
                 warmup=_OP_WARMUP[not cuda] if args.warmup is None else args.warmup, rep_ms=args.rep_ms,
                 check_max_tokens=args.check_max_tokens, seed=args.seed, gdn_guard=guard)
    env = environment(device)
    base = baseline_label(device, env["versions"])
    timing = (f"median of {s.reps} alternating rounds after {s.warmup} warm-up run(s) per side; each round one "
              f"triton.testing.do_bench median over {s.rep_ms:g} ms of runs" if cuda else
              f"median of {s.reps} alternating time.perf_counter runs after {s.warmup} warm-up run(s) per side")
    autotune = ("Triton autotune picks (FLA's and rewy's) kept from shape to shape" if args.keep_autotune_picks
                else "Triton autotune picks (FLA's and rewy's) forgotten before each shape, so each shape runs "
                     "the configs tuned at it")
    check = ("input gradients vs " + ("rewy's torch backend (policy full) on the same BF16 values in float32"
                                      if cuda else "the float64 reference recurrence on the same values")
             + "; relative Frobenius error, worst over the gradients; " + BOUND_CHECK)
    data = {"kind": "ops", **env, "baseline": baseline_description(device, env["versions"]), "settings": {
        "ops": ops, "policies": policies, "boundaries": boundaries, "backend": s.backend,
        "shapes": [sh.__dict__ for sh in shapes], "shapes_origin": origin,
        "qkv_dtype": str(s.qkv_dtype).removeprefix("torch."), "gates_dtype": "float32",
        "beta_b_w_dtype": str(s.qkv_dtype).removeprefix("torch."),
        "reps": s.reps, "warmup": s.warmup, "rep_ms": s.rep_ms if cuda else None, "timing": timing,
        "autotune": autotune if cuda else None,
        "check": check, "check_max_tokens": s.check_max_tokens, "gdn_guard": guard, "seed": s.seed},
        "rows": [], "complete": False}
    save = writer(args.json)
    print(f"rewy-hf bench (op level) on {data['device_name']}: {base} = {data['baseline']}")
    if not cuda:
        print("NOTE: CPU run: rewy's torch backend against the reference path in float32, not against FLA; "
              "these speedups say nothing about a GPU.")
    print(f"shapes: {origin}\ntiming: {timing}" + (f"\nautotune: {autotune}" if cuda else "")
          + f"\ncheck: {check}\n", flush=True)

    rows = data["rows"]
    tune_per_shape = cuda and not args.keep_autotune_picks
    if tune_per_shape:
        load_kernel_modules(ops)    # so that forget_picks sees every autotuner from the first shape on
    with progress(len(ops) * len(shapes) * len(policies), "rewy-hf bench") as bar:
        for op in ops:
            for shape in shapes:
                if tune_per_shape:
                    forget_picks()
                try:
                    ctx = ShapeContext(op, shape, s)
                except Exception as exc:   # the reference itself failed (e.g. out of memory): say where
                    for policy in policies:
                        rows.append({"op": op, "policy": policy, **shape.__dict__, "check_T": None,
                                     "check_reduced": False, "ok": False,
                                     "rewy_error": f"reference failed: {type(exc).__name__}: {exc}"})
                        bar.step(f"{op} {shape.label} {policy}: reference failed")
                    save(data)
                    continue
                for policy in policies:
                    row = run_config(ctx, policy, boundaries)
                    rows.append(row)
                    bar.write(format_row_line(row, boundaries, base))
                    bar.step(f"{op} {shape.label} {policy}")
                    save(data)        # a run killed half way still leaves its rows
                del ctx
                free_memory(device)

    print()
    for table in format_op_tables(rows, boundaries, base, device):
        print(table + "\n")
    data["geomean"] = geomeans(rows, boundaries)
    failed = [r for r in rows if not r.get("ok")]
    data.update(ok=not failed, exit_code=1 if failed else 0, complete=True)
    save(data)
    _write_markdown(args, data)
    if args.plot:
        plot_op_speedups(rows, boundaries, args.plot,
                         f"speedup = {base} time / rewy time ({data['device_name']}; >1: rewy faster)")
    print(f"rewy-hf bench: {len(rows) - len(failed)} of {len(rows)} configurations passed the gradient check"
          + ("" if not failed else "; failed: " + ", ".join(f"{r['op']} {r['policy']} {r['B']},{r['T']},{r['H']}"
                                                              for r in failed))
          + (f"; JSON: {args.json}" if args.json else "") + (f"; plot: {args.plot}" if args.plot else ""))
    return 1 if failed else 0


def _render(args) -> int:
    from .bench_merge import MergeError, merge_runs
    from .bench_ops import baseline_label
    from .bench_output import (format_model_result, format_op_tables, plot_model_steps, plot_op_speedups,
                               plot_unavailable)

    if args.plot and (reason := plot_unavailable()):
        return _could_not_run(reason)
    try:
        data = merge_runs(args.from_json)
    except MergeError as exc:
        return _could_not_run(str(exc))
    if data.get("error"):
        print(f"that run could not run: {data['error']}")
    elif data["kind"] == "model":
        print(format_model_result(data, data["settings"]["model"], data["settings"]))
        if args.plot:
            plot_model_steps(data, args.plot, f"{data['settings']['model']}, {data['device_name']}")
    else:
        rows, boundaries = data["rows"], data["settings"]["boundaries"]
        base = baseline_label(data["device"], data.get("versions"))
        for table in format_op_tables(rows, boundaries, base, data["device"]):
            print(table + "\n")
        if args.plot:
            plot_op_speedups(rows, boundaries, args.plot,
                             f"speedup = {base} time / rewy time ({data['device_name']}; >1: rewy faster)")
    if not data.get("complete", False):
        which = "one of these runs" if data.get("sources") else "that run"
        print(f"note: {which} did not finish (complete: false); these are the rows it wrote")
    _write_markdown(args, data)
    return int(data.get("exit_code", 1))


def _write_markdown(args, data: dict) -> None:
    if not getattr(args, "markdown", None):
        return
    from .bench_ops import baseline_label
    from .bench_output import markdown_report

    with open(args.markdown, "w", encoding="utf-8") as f:
        f.write(markdown_report(data, baseline_label(data.get("device", "cuda"), data.get("versions"))))
    print(f"Markdown: {args.markdown}")


def defaults_for(device: str) -> dict:
    """The device-dependent defaults, for the model-level command."""
    cpu = device != "cuda"
    return {"steps": _MODEL_STEPS[cpu], "warmup": _MODEL_WARMUP[cpu], "seq_len": _MODEL_SEQ[cpu],
            "dtype": "fp32" if cpu else "bf16"}
