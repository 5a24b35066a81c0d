"""`rewy-hf run`: run an unmodified training script with rewy patched in.

    rewy-hf run [--core rewy|original] [--backend auto|torch|triton] [--policy recompute|full]
                [--fallback error|original] [--json OUT.json] [--allow-no-backward] script.py ARGS...

The script runs in this process, as ``python script.py ARGS...`` would run it
(``rewy_hf.script_runner``). While it runs, every transformers / FLA model is
patched as soon as it is created: the switch ``rewy_hf.enable()`` turns on
(``rewy_hf.patching.auto_patch``), here with a recorder that also lists the
models without delta-rule layers. The original ``PreTrainedModel.post_init``
is put back, and the layers the run patched are restored, when the script
ends, however it ends.

Exit status: the script's own status if it failed; else 3 when ``--core rewy``
was asked but no optimized backward ran (unless ``--allow-no-backward``);
else 0. See docs/run.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..patching.dispatch import dispatch_report, report_difference, total_calls
from ..patching.auto_patch import RUN, disable, start, stop
from ..patching.model_creation import ModelRecorder
from ..patching.patch import FALLBACKS
from ..script_runner import EXIT_NO_SCRIPT, run_script
from ..validation import POLICIES
from .options import CORES, JsonReport, add_backend, add_json

HELP = "run an unmodified training script with every supported model patched as it is created"

# Exit status when `--core rewy` was asked and no optimized backward ran.
EXIT_NO_BACKWARD = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--core", choices=CORES, default="rewy",
                        help="rewy: patch every supported model's delta-rule core; original: patch nothing, "
                             "only report")
    add_backend(parser)
    parser.add_argument("--policy", choices=POLICIES, default="recompute",
                        help="what the rewy backward keeps from the forward")
    parser.add_argument("--fallback", choices=FALLBACKS, default="error",
                        help="calls rewy cannot serve: raise (error) or run the original core, "
                             "counted in the report (original)")
    add_json(parser, "the report", without="only a summary goes to stderr")
    parser.add_argument("--allow-no-backward", action="store_true",
                        help="exit 0 even if no optimized backward ran (e.g. an evaluation script)")
    parser.add_argument("script", help="the Python script to run, unmodified")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to the script as sys.argv[1:]")


def no_backward_reason(report: dict) -> str:
    """Why a run that asked for rewy's backward saw none, from its report."""
    models = report["models_created"]
    patched = [m for m in report["patched_models"] if m["patched"]]
    dispatch = report["dispatch"]
    if not models:
        return "the script created no transformers/FLA model (PreTrainedModel.post_init never ran)"
    if not patched:
        return (f"none of the {len(models)} model(s) it created ({', '.join(sorted(set(models)))}) "
                "has a supported delta-rule layer")
    forwards, fallbacks = total_calls(dispatch, "forward_calls"), total_calls(dispatch, "fallback_calls")
    if not forwards and fallbacks:
        return f"all {fallbacks} delta-rule call(s) fell back to the original core"
    if not forwards:
        return "no patched layer ran a chunked forward (was the model run at all?)"
    return (f"{forwards} delta-rule forward(s) ran through rewy but none was followed by a backward "
            "(forward under torch.no_grad / inference only?)")


def _table(header: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return ([fmt.format(*header), fmt.format(*("-" * w for w in widths))]
            + [fmt.format(*map(str, r)).rstrip() for r in rows])


def format_summary(report: dict) -> str:
    lines = [f"rewy-hf run: {report['script']} exited with status {report['script_exit_status']} "
             f"(core={report['core']}, backend={report['backend']}, policy={report['policy']}, "
             f"fallback={report['fallback']})"]
    models = report["models_created"]
    if report["core"] == "original":
        lines.append(f"models: {len(models)} created, none patched (core=original)")
    else:
        patched = report["patched_models"]
        n_layers = sum(len(m["patched"]) for m in patched)
        n_skipped = sum(len(m["skipped"]) for m in patched)
        lines.append(f"models: {len(models)} created, {sum(1 for m in patched if m['patched'])} patched "
                     f"({n_layers} delta-rule layer(s)), {n_skipped} delta-rule layer(s) not patched")
        for m in patched:
            ops = sorted({p["op"] for p in m["patched"]})
            lines.append(f"  {m['model']}: {len(m['patched'])} patched" + (f" [{', '.join(ops)}]" if ops else "")
                         + (f", {len(m['skipped'])} not patched" if m["skipped"] else ""))
            for s in m["skipped"]:
                lines.append(f"    not patched: {s['name']} ({s['layer_class']}): {s['reason']}")
    ops = report["dispatch"]["ops"]
    if ops:
        rows = [(op, e.get("forward_calls", 0), e.get("optimized_backward_calls", 0), e.get("fallback_calls", 0))
                for op, e in sorted(ops.items())]
        lines += _table(("op", "forward", "optimized backward", "fallback"), rows)
        for op, e in sorted(ops.items()):
            for reason, n in e.get("fallback_reasons", {}).items():
                lines.append(f"  fallback {op} x{n}: {reason}")
    elif report["core"] != "original":
        lines.append("no delta-rule call went through rewy")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    script = Path(args.script)
    argv = list(args.script_args or [])
    patching = args.core == "rewy"
    recorder = ModelRecorder({"backend": args.backend, "policy": args.policy, "fallback": args.fallback}
                             if patching else None)
    # Resolved now: the script may chdir.
    json_path = args.json if args.json in (None, "-") else str(Path(args.json).resolve())
    report_out = JsonReport(json_path)
    before = dispatch_report()

    if not script.is_file():
        status = EXIT_NO_SCRIPT
        error = f"can't open file {str(script)!r}: no such file"
        print(f"rewy-hf run: {error}", file=sys.stderr)
    else:
        switch = start(recorder, owner=RUN)
        try:
            status, error = run_script(script, argv)
        finally:
            try:
                stop(switch, unpatch=True)
                disable(unpatch=True)   # a switch the script turned on itself does not outlive it either
            except Exception as exc:    # the script's own outcome stays the result; the failed restore is said
                print(f"rewy-hf run: restoring the patched models failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
    after = dispatch_report()
    script_status = status

    report: dict[str, Any] = {
        "core": args.core,
        "backend": args.backend,
        "policy": args.policy,
        "fallback": args.fallback,
        "script": str(script),
        "argv": argv,
        "exit_status": status,
        "script_exit_status": script_status,
        "models_created": recorder.models(),
        "patched_models": recorder.patched_models(),
        "dispatch": report_difference(before, after),
        "error": error,
    }
    message = None
    if status == 0 and patching and total_calls(report["dispatch"], "optimized_backward_calls") == 0:
        reason = no_backward_reason(report)
        if args.allow_no_backward:
            message = f"rewy-hf run: note: no optimized backward ran: {reason} (allowed by --allow-no-backward)"
        else:
            status = EXIT_NO_BACKWARD
            message = (f"rewy-hf run: error: --core rewy was asked but no optimized backward ran: {reason}. "
                       "Pass --allow-no-backward if the script is not meant to train, or --core original "
                       f"to run it without rewy. Exiting with status {EXIT_NO_BACKWARD}.")
    report["exit_status"] = status

    print(format_summary(report), file=sys.stderr)
    if message:
        print(message, file=sys.stderr)
    if json_path is not None and json_path != "-":
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    report_out.finish(report)
    if json_path is not None and json_path != "-":
        print(f"rewy-hf run: report written to {args.json}", file=sys.stderr)
    return status
