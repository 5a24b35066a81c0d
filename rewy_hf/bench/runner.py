"""Running `rewy-hf bench` from its parsed options: the op level and the model level (two-sided,
``--compile``, ``--packed``). Each prints its progress and tables, keeps the --json report up to date
(``report.save`` as it goes, ``report.finish`` at the end, ``report.human_output()`` around what it
prints) and returns the exit status: 0 every check passed, 1 a check failed. A run that cannot start,
or stops before a result, raises ``CouldNotRun`` (exit status 2) with the reason and the fix.
"""

from __future__ import annotations

import sys
import warnings

from ..op_inputs import OPS
from ..validation import POLICIES
from .config import (BOUNDARIES, MODEL_DTYPE, MODEL_SEQ_LEN, MODEL_STEPS, MODEL_WARMUP, OP_REPS, OP_WARMUP,
                     PACKED_SEQ_LEN, PACKED_STEPS, environment, expand, given, on_cpu, resolve_shapes)
from .rows import as_json


class CouldNotRun(Exception):
    """A run that cannot start or stopped before its result (exit status 2); the message says why."""


class Progress:
    """A context manager: ``step(label)`` after each unit of work, ``write(line)`` for a result line.
    tqdm's bar on stderr where installed (result lines kept above it), else a flushed ``[i/n] label``
    line per unit, so that a long run in a pipe shows it is alive."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def step(self, label: str, units: int = 1) -> None:
        """``units`` of work done, now labelled ``label``; 0 units: only the label changes (work
        that takes long before its first unit, such as a first compiled step, says so)."""
        self.done += units
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=not units)
            self.bar.update(units)
        else:
            print(f"[{self.done}/{self.total}] {self.desc}: {label}", file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line)
        sys.stdout.flush()


def write_plot(args, data: dict) -> list[str]:
    """--plot of a finished run; the files written."""
    from .plots import plot_run

    return plot_run(data, args.plot) if args.plot and not data.get("error") else []


def run_bench(args, device: str, report, level=None) -> int:
    """A live run on ``device`` (the caller has checked that it is there); ``level``: a run of the
    caller's own in place of the op or model level, called as they are."""
    from .plots import plot_unavailable

    if args.plot and (reason := plot_unavailable()):
        raise CouldNotRun(reason)
    if device == "cpu":
        from ..cpu_triton import enable_cpu_interpreter

        enable_cpu_interpreter()
    guard = {"requested": bool(args.lift_gdn_guard), "was_active": None}
    if args.lift_gdn_guard and device == "cuda":
        from .op_bench import lift_gdn_guard

        guard = lift_gdn_guard()
    with warnings.catch_warnings(), report.human_output():
        # Each row names the backend that served it; the once-per-op warning adds nothing here.
        warnings.filterwarnings("ignore", message=r"rewy-hf: .* runs on the torch backend on GPU")
        if level is None:
            level = run_model if args.model else run_ops
        return level(args, device, guard, report)


def op_settings(args, device: str, guard: dict, **more):
    """The op-level settings from the options, with the defaults of ``device``."""
    from .op_bench import Settings

    cpu = on_cpu(device)
    return Settings(device=device, backend=args.backend, reps=args.reps or OP_REPS[cpu],
                    warmup=OP_WARMUP[cpu] if args.warmup is None else args.warmup, rep_ms=args.rep_ms,
                    check_max_tokens=args.check_max_tokens, seed=args.seed, gdn_guard=guard, **more)


def run_ops(args, device: str, guard: dict, report, extra=None) -> int:
    """The op level; ``extra``: what a caller adds to it (an ``op_bench.Extra``)."""
    from .op_bench import Extra, baseline_label
    from .op_run import OpRun, conclude, describe_run, run_rows
    from .tables import format_op_tables, format_row_line, shape_label

    cuda = device == "cuda"
    shapes, origin = resolve_shapes(args.shapes, device)
    s = op_settings(args, device, guard, extra=extra or Extra())
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
    with Progress(len(plan.ops) * len(shapes) * len(plan.policies), "rewy-hf bench") as bar:
        run_rows(plan, data, save=lambda d: report.save(as_json(d)), step=bar.step,
                 on_row=lambda row: bar.write(format_row_line(row, plan.boundaries, base)
                                              + s.extra.after_row(row, plan.boundaries)))
    rows = data["rows"]
    print()
    for table in format_op_tables(rows, plan.boundaries, base, device, more=s.extra.tables):
        print(table + "\n")
    failed = conclude(data)
    report.save(as_json(data))
    plots = write_plot(args, data)
    print(f"rewy-hf bench: {len(rows) - len(failed)} of {len(rows)} configurations passed the gradient check"
          + ("" if not failed else "; failed: " + ", ".join(f"{r.op} {r.policy} {shape_label(r)}" for r in failed))
          + (f"; JSON: {args.json}" if args.json and not report.to_stdout else "")
          + (f"; plot: {', '.join(plots)}" if plots else ""))
    report.finish(as_json(data))
    return 1 if failed else 0


# --- model level --------------------------------------------------------------------------------

class ModelRun:
    """What the model-level runs share: the options, settings and report, and how a run ends."""

    def __init__(self, args, device: str, guard: dict, report):
        self.args, self.report = args, report
        cpu = on_cpu(device)
        if op_only := given(args, "--op", "--shapes", "--boundary", "--reps"):
            raise CouldNotRun(f"{', '.join(op_only)} apply to the op-level bench; drop them, or drop --model "
                              "(the model level times --steps training steps)")
        policies = expand(args.policy, POLICIES, "both", ("recompute",))
        if len(policies) != 1:
            raise CouldNotRun("--model takes one --policy (recompute or full); run it once per policy")
        if args.packed and (mixed := given(args, "--compile", "--curve-steps", "--lengths", "--causal-masks")):
            raise CouldNotRun(f"{', '.join(mixed)} belong to the --compile bench; --packed runs its own compiled "
                              "sides (choose them with --sides)")
        if args.packed and args.batch_size != 1:
            raise CouldNotRun("--packed packs one row per step (B = 1, as the padding-free collators do); drop "
                              "--batch-size")
        from .model_bench import ModelSettings, describe_model_run

        self.dtype = args.dtype or MODEL_DTYPE[cpu]
        steps, seq_len = (PACKED_STEPS[cpu], PACKED_SEQ_LEN[cpu]) if args.packed else \
            (MODEL_STEPS[cpu], MODEL_SEQ_LEN[cpu])
        self.s = ModelSettings(device=device, steps=args.steps or steps,
                               warmup=MODEL_WARMUP[cpu] if args.warmup is None else args.warmup,
                               batch_size=args.batch_size, seq_len=args.seq_len or seq_len, backend=args.backend,
                               policy=policies[0], seed=args.seed)
        self.settings = describe_model_run(args.model, self.s, self.dtype, guard)
        self.data = {"kind": "model", **environment(device), "settings": self.settings, "complete": False}

    def load(self):
        import torch

        from ..models.loading import ModelLoadError, load_causal_lm

        a = self.args
        print(f"rewy-hf bench (model level) on {self.data['device_name']}: loading {a.model} ({self.dtype})",
              flush=True)
        try:
            model = load_causal_lm(a.model, revision=a.revision, dtype=getattr(torch, self.dtype),
                                   device=self.s.device, trust_remote_code=a.trust_remote_code, seed=a.seed).model
        except (ModelLoadError, ValueError) as exc:
            self.failed(str(exc))
        self.settings["parameters"] = sum(p.numel() for p in model.parameters())
        return model

    def failed(self, message: str):
        self.data.update(ok=False, exit_code=2, error=message, complete=True)
        self.report.finish(self.data)
        raise CouldNotRun(f"could not run: {message}")

    def measure(self, total: int, desc: str, work, unpatched: str = "the unpatched sides"):
        """``work(bar)`` under a progress bar; a failure ends the run with its reason (and where FLA's GDN
        guard stopped ``unpatched``, the way round it)."""
        from ..errors import UnsupportedConfigError

        try:
            with Progress(total, desc) as bar:
                return work(bar)
        except UnsupportedConfigError as exc:    # says itself what is not supported
            self.failed(str(exc))
        except Exception as exc:   # e.g. the unpatched core refusing to run on this GPU
            hint = (f"; FLA refuses its GDN backward here (Hopper, triton < 3.7.1): add --lift-gdn-guard to time "
                    f"{unpatched} anyway") if "#640" in str(exc) else ""
            self.failed(f"{type(exc).__name__}: {exc}{hint}")

    def save_side(self, side: str, row: dict) -> None:
        self.data.setdefault("sides", {})[side] = row
        self.report.save(self.data)       # a run stopped half way keeps the sides it finished

    def finish(self, text: str, problems: list[str]) -> int:
        """Print the result, write the reports and the plot; the exit status."""
        print(text)
        self.data.update(ok=not problems, exit_code=1 if problems else 0, problems=problems, complete=True)
        self.report.finish(self.data)
        write_plot(self.args, self.data)
        for p in problems:
            print(f"FAIL: {p}", file=sys.stderr)
        return 1 if problems else 0


def run_model(args, device: str, guard: dict, report) -> int:
    from .model_bench import model_problems, run_model_bench
    from .tables import format_model_result

    run = ModelRun(args, device, guard, report)
    model = run.load()
    if args.packed:
        return run_packed(run, model)
    if args.compile:
        return run_compiled(run, model)
    if args.curve_steps or args.lengths or args.sides:
        run.failed("--curve-steps, --lengths and --sides apply to --compile runs; add --compile or drop them")
    s, data = run.s, run.data
    data.update(run.measure(s.warmup + s.steps, f"bench {args.model}",
                            lambda bar: run_model_bench(model, s, progress=bar.step), "the unpatched side"))
    return run.finish(format_model_result(data, args.model, run.settings), model_problems(data))


def run_packed(run: ModelRun, model) -> int:
    """--model X --packed: bench/packed_bench.py."""
    from .packed_bench import ALL_SIDES, packed_problems, packed_summary, run_packed_bench
    from .tables import format_packed_result

    args, s, data = run.args, run.s, run.data
    data["kind"] = "packed"
    sides = tuple(ALL_SIDES if args.sides is None else args.sides)
    if any("compiled" in x for x in sides) and s.warmup < 1:
        run.failed("compiled sides need --warmup 1 or more: their first step compiles")
    run.settings.update(
        sides=list(sides), documents="log-normal lengths (median 600 tokens or a row's eighth, sigma 1, at least "
        "16), the last cut at the row's end; a new packing every step",
        peak_memory="torch.cuda.max_memory_allocated over the side's steps minus what was allocated before them "
                    "(weights, optimizer state, the restore snapshot)",
        timing="time.perf_counter around each full step (device synchronised); the sides run one after the other "
               "on the same weights, optimizer state and packings")
    if not args.no_documents_check:
        print("documents check: one packed row against its documents run one by one", flush=True)

    def work(bar):
        def on_side(side: str, row: dict) -> None:
            if "skipped" in row:
                bar.step(side, s.warmup + s.steps)
                bar.write(f"{side}: skipped ({row['skipped']})")
            else:
                peak = "" if row["peak_mb"] is None else f", peak {row['peak_mb']:.0f} MB"
                bar.write(f"{side}: median {row['median_step_ms']:.1f} ms, max {row['max_step_ms']:.1f}, "
                          f"{row['tokens_per_s']:.0f} tokens/s{peak}"
                          + (f", {row['graphs']} graphs, {row['graph_breaks']} breaks" if "graphs" in row else ""))
            run.save_side(side, row)

        def on_check(check: dict) -> None:
            data["documents_check"] = check
            run.report.save(data)

        return run_packed_bench(model, device=s.device, steps=s.steps, warmup=s.warmup, seq_len=s.seq_len,
                                seed=s.seed, backend=s.backend, policy=s.policy, sides=sides,
                                check=not args.no_documents_check, on_side=on_side, on_check=on_check,
                                step=bar.step, on_partial=run.save_side)

    data.update(run.measure(len(sides) * (s.warmup + s.steps), f"bench {args.model} --packed", work))
    data["summary"] = packed_summary(data)
    return run.finish(format_packed_result(data), packed_problems(data))


def run_compiled(run: ModelRun, model) -> int:
    """--model X --compile: the four sides of bench/compile_bench.py."""
    from .compile_bench import SIDES, compile_problems, run_compile_bench
    from .tables import format_compile_result, format_side

    args, s, data = run.args, run.s, run.data
    if s.warmup < 1:
        run.failed("--compile needs --warmup 1 or more: a compiled side's first step compiles, and timing it "
                   "would report the compile time as a step")
    run.settings["compile"] = "torch.compile(model) defaults (inductor, automatic dynamic shapes); sides in blocks"
    curve = args.curve_steps or 0
    sides = args.sides or SIDES
    if liger := [x for x in sides if x not in SIDES]:
        run.failed(f"{', '.join(liger)}: the Liger-Kernel sides belong to --packed runs")
    run.settings.update(curve_steps=curve, lengths=list(args.lengths), sides=list(sides),
                        causal_masks=args.causal_masks)
    total = len(sides) * (s.warmup + s.steps + curve) + sum(x.endswith("compiled") for x in sides) * len(args.lengths)

    def work(bar):
        def on_side(side: str, row: dict) -> None:
            bar.write(format_side(side, row))
            data["tokens_per_step"] = s.batch_size * s.seq_len
            run.save_side(side, row)

        return run_compile_bench(model, s, progress=bar.step, on_side=on_side, curve_steps=curve,
                                 lengths=args.lengths, sides=sides, causal_masks=args.causal_masks)

    res = run.measure(total, f"bench {args.model} --compile", work)
    data.update(res)
    return run.finish(format_compile_result(data, args.model), compile_problems(res))

