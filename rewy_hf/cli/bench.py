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

from ..validation import POLICIES
from .options import NO_CUDA, JsonReport, add_backend, add_dtype, add_json, at_least, chosen_device

HELP = "time FLA vs rewy per op (with a gradient check of every configuration), or a whole model's training step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..op_inputs import OPS
    from ..bench.config import BOUNDARIES, MODEL_DTYPES, parse_shape

    parser.add_argument("--model", default=None, metavar="SPEC",
                        help="model-level bench of this hub id, local directory or preset (qwen3.5-1b, gdn2-1b, "
                             "tiny-qwen3.5, tiny-fla-gdn2, ...); without it the op-level bench runs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if available, else cpu (CPU compares against the reference path, not FLA)")
    parser.add_argument("--policy", nargs="+", action="extend", choices=(*POLICIES, "both"), default=None,
                        help="what rewy's forward saves for backward; op level default: both; model level: one "
                             "(default recompute)")
    add_backend(parser)
    parser.add_argument("--warmup", type=at_least(0), default=None,
                        help="untimed runs per side first (op default: 3 on CUDA, 1 on CPU; model: 2 / 1 steps)")
    parser.add_argument("--lift-gdn-guard", action="store_true",
                        help="let FLA 0.6.0 run its GDN backward on Hopper with triton < 3.7.1 (which it refuses, FLA "
                             "#640) so it can be timed; that baseline is marked timing only and its gradients are "
                             "never compared")
    add_json(parser, "settings, versions and every row")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="bar chart of the speedups (needs matplotlib); with --kernel-profile also "
                             "OUT-kernels.png, each side's time stacked by kernel")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (and the model's weights)")
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
    ops.add_argument("--reps", type=at_least(1), default=None,
                     help="timed rounds per side, alternating (default 5 on CUDA, 3 on CPU); the median is "
                          "reported. On CUDA each round is one triton do_bench median over --rep-ms")
    ops.add_argument("--keep-autotune-picks", action="store_true",
                     help="CUDA: keep Triton's autotune picks from one shape to the next (default: forget them "
                          "before each shape, so each is timed with the configs tuned at it, as a run at that "
                          "shape alone would be; FLA's keys leave out B and T)")
    ops.add_argument("--peers", nargs="+", action="extend", choices=("fla-triton", "flash-qla", "all"), default=None,
                     help="CUDA: also time these baselines beside FLA as installed, alternating with it and rewy "
                          "on the same inputs, each gradient-checked: fla-triton (FLA with its backend dispatch "
                          "off, so no FlashQLA or TileLang kernels: what FLA_DISABLE_BACKEND_DISPATCH=1 gives), "
                          "flash-qla (FlashQLA's own entry, GDN only); all: both. A peer that does not apply here "
                          "(not installed, another op) is listed with the reason")
    ops.add_argument("--kernel-profile", action="store_true",
                     help="after each side's timing, profile one more of its runs with torch.profiler and list "
                          "where its time goes: device time and launches per kernel on CUDA (per ATen operator, "
                          "self time, on CPU), beside the other sides', per configuration and boundary")
    ops.add_argument("--context-parallel", action="store_true",
                     help="launched as N processes (torchrun --nproc-per-node N -m rewy_hf bench ...; one GPU "
                          "each, gloo on CPU): each --shapes row (B = 1, T divisible by N) is split across them "
                          "with FLA's cp_context, and rewy's op is timed against FLA's on every slice (gdn, kda, "
                          "gdn2); a round's time is the slowest process's")
    ops.add_argument("--rep-ms", type=float, default=50.0, help="CUDA: milliseconds of runs per round")
    ops.add_argument("--check-max-tokens", type=at_least(64), default=2**19, metavar="N",
                     help="shapes with B*T*H above N are gradient-checked at a reduced T (same B, H; said in the "
                          "output) to save time and memory")

    model = parser.add_argument_group("model level (--model)")
    model.add_argument("--seq-len", type=at_least(1), default=None,
                       help="tokens per sequence (default 4096 on CUDA, 128 on CPU)")
    model.add_argument("--batch-size", type=at_least(1), default=1, help="sequences per step")
    model.add_argument("--steps", type=at_least(1), default=None,
                       help="timed steps per side (default 10 on CUDA, 2 on CPU)")
    add_dtype(model, MODEL_DTYPES, None, "model dtype (default bfloat16 on CUDA, float32 on CPU)")
    model.add_argument("--compile", action="store_true",
                       help="time four sides: unpatched and patched, each eager and under torch.compile (or "
                            "some: --sides)")
    model.add_argument("--curve-steps", type=at_least(1), default=None, metavar="N",
                       help="--compile: each side also trains N consecutive steps on fresh batches of the bundled "
                            "corpus from the same weights, and its loss curve is compared with the unpatched eager one")
    model.add_argument("--lengths", type=parse_lengths, default=(), metavar="T,T,...",
                       help="--compile: each compiled side also runs one step at each of these sequence lengths "
                            "and reports how many graphs each compiled (0: no recompile)")
    model.add_argument("--sides", type=parse_sides, default=None, metavar="SIDE,SIDE,...",
                       help="--compile: run only these of the four sides (unpatched-eager, patched-eager, "
                            "patched-compiled, unpatched-compiled); --packed: also unpatched-eager-liger, "
                            "patched-eager-liger, patched-compiled-liger; e.g. to time the slow-to-compile unpatched "
                            "compiled side in a run of its own; `--from-json` of runs on the same settings joins "
                            "their sides into one table (default: all four)")
    model.add_argument("--causal-masks", action="store_true",
                       help="--compile: every side hands a transformers hybrid the mask mapping of an unpadded "
                            "causal batch (models/causal_masks.py), so that compiled attention runs SDPA's causal "
                            "kernel as eager attention does, instead of a materialized mask")
    model.add_argument("--packed", action="store_true",
                       help="time padding-free packed fine-tuning as Trainer / TRL feed it: one row of --seq-len "
                            "tokens (default 8192) packed from long-tailed documents, a new packing each of --steps "
                            "steps (default 50), on up to seven sides: unpatched / patched, eager / compiled, with "
                            "Liger-Kernel where it is installed (--sides names them, or `none` for the documents "
                            "check alone); before the timing, a packed row against its documents run one by one")
    model.add_argument("--no-documents-check", action="store_true",
                       help="--packed: skip the packed row's check against its documents run one by one")
    model.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="let transformers run the model repository's own code")


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of sequence lengths, "
                                         "e.g. 2048,8192") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every sequence length must be 1 or more")
    return lengths


def parse_sides(text: str) -> tuple[str, ...]:
    from ..bench.packed_bench import ALL_SIDES, side_name

    if text.strip() == "none":
        return ()
    names = {side_name(side): side for side in ALL_SIDES}
    picked = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in picked if x not in names]
    if unknown or not picked:
        raise argparse.ArgumentTypeError(f"{text!r}: sides are {', '.join(names)} (comma-separated; the -liger "
                                         "ones with --packed only), or none")
    return tuple(side for name, side in names.items() if name in picked)


def could_not_run(message: str) -> int:
    print(f"rewy-hf bench: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from ..bench.output import plot_unavailable
    from ..cpu_triton import enable_cpu_interpreter

    if args.from_json:
        return render(args)
    device = chosen_device(args.device)
    if device is None:
        return could_not_run(f"{NO_CUDA} (a comparison against the reference path) or a CUDA build of torch")
    if args.plot and (reason := plot_unavailable()):
        return could_not_run(reason)
    if args.context_parallel:
        from ..bench.cp_bench import refusal

        if (reason := refusal(args, device)) is not None:
            return could_not_run(reason)
    if device == "cpu":
        enable_cpu_interpreter()
    guard = {"requested": bool(args.lift_gdn_guard), "was_active": None}
    if args.lift_gdn_guard and device == "cuda":
        from ..bench.op_bench import lift_gdn_guard

        guard = lift_gdn_guard()
    report = JsonReport(args.json)
    with warnings.catch_warnings(), report.human_output():
        # Each row names the backend that served it; the once-per-op warning adds nothing here.
        warnings.filterwarnings("ignore", message=r"rewy-hf: .* runs on the torch backend on GPU")
        if args.model:
            return run_model(args, device, guard, report)
        if args.context_parallel:
            from ..bench.cp_bench import run_cp

            return run_cp(args, device, guard, report)
        return run_ops(args, device, guard, report)


def run_ops(args, device: str, guard: dict, report: JsonReport) -> int:
    from ..bench.config import BOUNDARIES, OP_REPS, OP_WARMUP, expand, on_cpu, resolve_shapes
    from ..bench.op_bench import PEERS, Settings, baseline_label
    from ..bench.op_run import OpRun, conclude, describe_run, run_rows
    from ..bench.output import format_op_tables, format_row_line, plot_op_run, progress, shape_label
    from ..op_inputs import OPS

    cuda = device == "cuda"
    shapes, origin = resolve_shapes(args.shapes, device)
    s = Settings(device=device, backend=args.backend, reps=args.reps or OP_REPS[on_cpu(device)],
                 warmup=OP_WARMUP[on_cpu(device)] if args.warmup is None else args.warmup, rep_ms=args.rep_ms,
                 check_max_tokens=args.check_max_tokens, seed=args.seed, gdn_guard=guard,
                 peers=tuple(expand(args.peers, PEERS, "all", ())), kernel_profile=args.kernel_profile)
    plan = OpRun(ops=expand(args.op, OPS, "all", OPS), policies=expand(args.policy, POLICIES, "both", POLICIES),
                 boundaries=expand(args.boundary, BOUNDARIES, "both", BOUNDARIES), shapes=shapes,
                 shapes_origin=origin, settings=s, keep_autotune_picks=args.keep_autotune_picks)
    data = describe_run(plan)
    st = data["settings"]
    base = baseline_label(device, data["versions"])
    print(f"rewy-hf bench (op level) on {data['device_name']}: {base} = {data['baseline']}")
    if not cuda:
        print("NOTE: CPU run: rewy's torch backend against the reference path in float32, not against FLA; "
              "these speedups say nothing about a GPU.")
    print(f"shapes: {origin}\ntiming: {st['timing']}" + (f"\nautotune: {st['autotune']}" if cuda else "")
          + f"\ncheck: {st['check']}\n", flush=True)

    with progress(len(plan.ops) * len(shapes) * len(plan.policies), "rewy-hf bench") as bar:
        run_rows(plan, data, save=report.save, step=bar.step,
                 on_row=lambda row: bar.write(format_row_line(row, plan.boundaries, base)))
    rows = data["rows"]
    print()
    for table in format_op_tables(rows, plan.boundaries, base, device):
        print(table + "\n")
    failed = conclude(data)
    report.save(data)
    write_markdown(args, data)
    plots = plot_op_run(rows, plan.boundaries, args.plot, base, data["device_name"], device) if args.plot else []
    print(f"rewy-hf bench: {len(rows) - len(failed)} of {len(rows)} configurations passed the gradient check"
          + ("" if not failed else "; failed: " + ", ".join(f"{r['op']} {r['policy']} {shape_label(r)}"
                                                              for r in failed))
          + (f"; JSON: {args.json}" if args.json and not report.to_stdout else "")
          + (f"; plot: {', '.join(plots)}" if plots else ""))
    report.finish(data)
    return 1 if failed else 0


def run_model(args, device: str, guard: dict, report: JsonReport) -> int:
    import torch

    from ..bench.config import (MODEL_DTYPE, MODEL_SEQ_LEN, MODEL_STEPS, MODEL_WARMUP, PACKED_SEQ_LEN, PACKED_STEPS,
                                expand, on_cpu)
    from ..bench.model_bench import ModelSettings, describe_model_run, model_problems, run_model_bench
    from ..bench.output import environment, format_model_result, plot_model_steps, progress
    from ..errors import UnsupportedConfigError
    from ..models.loading import ModelLoadError, load_causal_lm

    op_only = [flag for flag, value in (("--op", args.op), ("--shapes", args.shapes), ("--boundary", args.boundary),
                                        ("--reps", args.reps), ("--peers", args.peers),
                                        ("--kernel-profile", args.kernel_profile)) if value]
    if op_only:
        return could_not_run(f"{', '.join(op_only)} apply to the op-level bench; drop them, or drop --model "
                             "(the model level times --steps training steps)")
    policies = expand(args.policy, POLICIES, "both", ("recompute",))
    if len(policies) != 1:
        return could_not_run("--model takes one --policy (recompute or full); run it once per policy")
    cpu = on_cpu(device)
    if args.packed and (reason := packed_refusal(args, device)):
        return could_not_run(reason)
    dtype_name = args.dtype or MODEL_DTYPE[cpu]
    steps, seq_len = (PACKED_STEPS[cpu], PACKED_SEQ_LEN[cpu]) if args.packed else (MODEL_STEPS[cpu], MODEL_SEQ_LEN[cpu])
    s = ModelSettings(device=device, steps=args.steps or steps,
                      warmup=MODEL_WARMUP[cpu] if args.warmup is None else args.warmup, batch_size=args.batch_size,
                      seq_len=args.seq_len or seq_len, backend=args.backend, policy=policies[0],
                      seed=args.seed)
    settings = describe_model_run(args.model, s, dtype_name, guard)
    data = {"kind": "model", **environment(device), "settings": settings, "complete": False}

    def failed_to_run(message: str) -> int:
        data.update(ok=False, exit_code=2, error=message, complete=True)
        report.finish(data)
        return could_not_run(f"could not run: {message}")

    print(f"rewy-hf bench (model level) on {data['device_name']}: loading {args.model} ({dtype_name})", flush=True)
    try:
        loaded = load_causal_lm(args.model, revision=args.revision, dtype=getattr(torch, dtype_name), device=device,
                                trust_remote_code=args.trust_remote_code, seed=args.seed)
    except (ModelLoadError, ValueError) as exc:
        return failed_to_run(str(exc))
    model = loaded.model
    settings["parameters"] = sum(p.numel() for p in model.parameters())
    if args.packed:
        return run_packed_model(args, model, s, settings, data, failed_to_run, report)
    if args.compile:
        return run_compiled_model(args, model, s, settings, data, failed_to_run, report)
    if not args.compile and (args.curve_steps or args.lengths or args.sides):
        return failed_to_run("--curve-steps, --lengths and --sides apply to --compile runs; add --compile or drop "
                             "them")
    try:
        with progress(s.warmup + s.steps, f"bench {args.model}") as bar:
            res = run_model_bench(model, s, progress=bar.step)
    except UnsupportedConfigError as exc:
        return failed_to_run(str(exc))
    except Exception as exc:   # e.g. the unpatched core refusing to run on this GPU
        hint = ""
        if "#640" in str(exc):
            hint = ("; FLA refuses its GDN backward here (Hopper, triton < 3.7.1): add --lift-gdn-guard to time the "
                    "unpatched side anyway")
        return failed_to_run(f"{type(exc).__name__}: {exc}{hint}")

    print(format_model_result(res, args.model, settings))
    problems = model_problems(res)
    data.update(res)
    data.update(ok=not problems, exit_code=1 if problems else 0, problems=problems, complete=True)
    report.finish(data)
    write_markdown(args, data)
    if args.plot:
        plot_model_steps(res, args.plot, f"{args.model}, {s.batch_size}x{s.seq_len} tokens, {dtype_name}, "
                                         f"{data['device_name']}")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


def packed_refusal(args, device: str) -> str | None:
    """Why --packed cannot run with these options, or None."""
    mixed = [flag for flag, value in (("--compile", args.compile), ("--curve-steps", args.curve_steps),
                                      ("--lengths", args.lengths), ("--causal-masks", args.causal_masks)) if value]
    if mixed:
        return (f"{', '.join(mixed)} belong to the --compile bench; --packed runs its own compiled sides "
                "(choose them with --sides)")
    if args.batch_size != 1:
        return "--packed packs one row per step (B = 1, as the padding-free collators do); drop --batch-size"
    return None


def run_packed_model(args, model, s, settings: dict, data: dict, failed_to_run, report: JsonReport) -> int:
    """--model X --packed: bench/packed_bench.py."""
    from ..bench.output import progress
    from ..bench.packed_bench import (ALL_SIDES, LIGER_SIDES, SIDES, format_packed_result, packed_problems,
                                      packed_summary, plot_packed, run_packed_bench)

    data["kind"] = "packed"
    sides = tuple(ALL_SIDES if args.sides is None else args.sides)
    if any("compiled" in x for x in sides) and s.warmup < 1:
        return failed_to_run("compiled sides need --warmup 1 or more: their first step compiles")
    settings.update(sides=list(sides), documents="log-normal lengths (median 600 tokens or a row's eighth, sigma 1, at least 16), "
                    "the last cut at the row's end; a new packing every step",
                    peak_memory="torch.cuda.max_memory_allocated over the side's steps minus what was allocated "
                                "before them (weights, optimizer state, the restore snapshot)",
                    timing="time.perf_counter around each full step (device synchronised); the sides run one "
                           "after the other on the same weights, optimizer state and packings")
    if not args.no_documents_check:
        print("documents check: one packed row against its documents run one by one", flush=True)
    total = len(sides) * (s.warmup + s.steps)
    try:
        with progress(total, f"bench {args.model} --packed") as bar:
            def on_side(side: str, row: dict) -> None:
                data.setdefault("sides", {})[side] = row
                if "skipped" in row:
                    bar.step(side, s.warmup + s.steps)
                    bar.write(f"{side}: skipped ({row['skipped']})")
                else:
                    peak = "" if row["peak_mb"] is None else f", peak {row['peak_mb']:.0f} MB"
                    bar.write(f"{side}: median {row['median_step_ms']:.1f} ms, max {row['max_step_ms']:.1f}, "
                              f"{row['tokens_per_s']:.0f} tokens/s{peak}"
                              + (f", {row['graphs']} graphs, {row['graph_breaks']} breaks" if "graphs" in row
                                 else ""))
                report.save(data)       # a run stopped half way keeps the sides it finished

            def on_check(check: dict) -> None:
                data["documents_check"] = check
                report.save(data)

            res = run_packed_bench(model, device=s.device, steps=s.steps, warmup=s.warmup, seq_len=s.seq_len, seed=s.seed,
                                   backend=s.backend, policy=s.policy, sides=sides,
                                   check=not args.no_documents_check, on_side=on_side, on_check=on_check,
                                   step=bar.step)
    except Exception as exc:
        hint = ("; FLA refuses its GDN backward here (Hopper, triton < 3.7.1): add --lift-gdn-guard to time the "
                "unpatched sides anyway") if "#640" in str(exc) else ""
        return failed_to_run(f"{type(exc).__name__}: {exc}{hint}")
    data.update(res)
    data["summary"] = packed_summary(data)
    print(format_packed_result(data))
    problems = packed_problems(data)
    data.update(ok=not problems, exit_code=1 if problems else 0, problems=problems, complete=True)
    report.finish(data)
    write_markdown(args, data)
    if args.plot and data.get("sides"):
        plot_packed(data, args.plot, f"{args.model}, 1x{s.seq_len} packed tokens, {data['device_name']}")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


def run_compiled_model(args, model, s, settings: dict, data: dict, failed_to_run, report: JsonReport) -> int:
    """--model X --compile: the four sides of bench/compile_bench.py."""
    from ..bench.compile_bench import SIDES, compile_problems, format_compile_result, format_side, run_compile_bench
    from ..bench.output import progress

    if s.warmup < 1:
        return failed_to_run("--compile needs --warmup 1 or more: a compiled side's first step compiles, and "
                             "timing it would report the compile time as a step")
    settings["compile"] = "torch.compile(model) defaults (inductor, automatic dynamic shapes); sides in blocks"
    curve = args.curve_steps or 0
    sides = args.sides or SIDES
    if liger := [x for x in sides if x not in SIDES]:
        return failed_to_run(f"{', '.join(liger)}: the Liger-Kernel sides belong to --packed runs")
    settings.update(curve_steps=curve, lengths=list(args.lengths), sides=list(sides),
                    causal_masks=args.causal_masks)
    total = len(sides) * (s.warmup + s.steps + curve) + sum(x.endswith("compiled") for x in sides) * len(args.lengths)
    try:
        with progress(total, f"bench {args.model} --compile") as bar:
            def on_side(side: str, row: dict) -> None:
                bar.write(format_side(side, row))
                data.setdefault("sides", {})[side] = row
                data["tokens_per_step"] = s.batch_size * s.seq_len
                report.save(data)       # a run stopped half way keeps the sides it finished

            res = run_compile_bench(model, s, progress=bar.step, on_side=on_side, curve_steps=curve,
                                    lengths=args.lengths, sides=sides, causal_masks=args.causal_masks)
    except Exception as exc:
        hint = ("; FLA refuses its GDN backward here (Hopper, triton < 3.7.1): add --lift-gdn-guard to time the "
                "unpatched sides anyway") if "#640" in str(exc) else ""
        return failed_to_run(f"{type(exc).__name__}: {exc}{hint}")
    data.update(res)
    print(format_compile_result(data, args.model))
    problems = compile_problems(res)
    data.update(ok=not problems, exit_code=1 if problems else 0, problems=problems, complete=True)
    report.finish(data)
    write_markdown(args, data)
    if args.plot:
        from ..bench.output import plot_compile_result

        plot_compile_result(res, args.plot, f"{args.model}, {s.batch_size}x{s.seq_len} tokens, {data['device_name']}")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


def render(args) -> int:
    """--from-json: the tables (and plot, Markdown) of earlier runs, with their exit status."""
    from ..bench.merge import MergeError, merge_runs
    from ..bench.op_bench import baseline_label
    from ..bench.output import format_model_result, format_op_tables, plot_model_steps, plot_op_run, plot_unavailable

    if args.plot and (reason := plot_unavailable()):
        return could_not_run(reason)
    try:
        data = merge_runs(args.from_json)
    except MergeError as exc:
        return could_not_run(str(exc))
    if data.get("error"):
        print(f"that run could not run: {data['error']}")
    elif data["kind"] == "model" and "sides" in data:
        from ..bench.compile_bench import format_compile_result

        print(format_compile_result(data, data["settings"]["model"]))
        if args.plot:
            from ..bench.output import plot_compile_result

            plot_compile_result(data, args.plot, f"{data['settings']['model']}, {data['device_name']}")
    elif data["kind"] == "packed":
        from ..bench.packed_bench import format_packed_result, plot_packed

        print(format_packed_result(data))
        if args.plot and data.get("sides"):
            plot_packed(data, args.plot, f"{data['settings']['model']}, 1x{data['settings']['seq_len']} packed tokens, "
                                         f"{data['device_name']}")
    elif data["kind"] == "context_parallel":
        from ..bench.cp_bench import format_rows

        print(format_rows(data["rows"]))
        if args.plot:
            print("note: --context-parallel runs have a table and no plot")
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
            plot_op_run(rows, boundaries, args.plot, base, data["device_name"], data.get("device", "cuda"))
    if not data.get("complete", False):
        which = "one of these runs" if data.get("sources") else "that run"
        print(f"note: {which} did not finish (complete: false); these are the rows it wrote")
    write_markdown(args, data)
    return int(data.get("exit_code", 1))


def write_markdown(args, data: dict) -> None:
    if not args.markdown:
        return
    from ..bench.op_bench import baseline_label
    from ..bench.output import markdown_report

    if data.get("kind") == "context_parallel":
        from ..bench.cp_bench import format_rows

        text = format_rows(data["rows"]) + "\n"
    elif data.get("kind") == "packed":
        from ..bench.packed_bench import format_packed_result

        text = format_packed_result(data, markdown=True) + "\n"
    else:
        text = markdown_report(data, baseline_label(data.get("device", "cuda"), data.get("versions")))
    with open(args.markdown, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"Markdown: {args.markdown}")
