"""`rewy-hf run`: run an unmodified training script with rewy patched in.

    rewy-hf run [--backend optimized|original] [--policy recompute|full]
                [--fallback error|original] [--report out.json]
                [--allow-no-backward] script.py ARGS...

The script runs in this process, as ``python script.py ARGS...`` would run it
(``__name__ == "__main__"``, ``sys.argv == [script.py, *ARGS]``, the script's
folder first on ``sys.path``). While it runs, ``PreTrainedModel.post_init`` --
which every transformers model (and every ``fla.models`` model, which subclass
``PreTrainedModel``) calls at the end of its ``__init__``, including inside
``from_pretrained`` -- is wrapped so that each new model is patched with
``patch_model(model, strict=False, ...)`` as soon as it exists. The original
``post_init`` is put back when the script ends, however it ends.

Exit status: the script's own status if it failed; else 3 when ``optimized``
was asked but no optimized backward ran (unless ``--allow-no-backward``);
else 0. See docs/run.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import runpy
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

HELP = "run an unmodified training script with every supported model patched as it is created"

BACKENDS = ("optimized", "original")
POLICIES = ("recompute", "full")
FALLBACKS = ("error", "original")

# Exit status when `optimized` was asked and no optimized backward ran.
EXIT_NO_BACKWARD = 3
# Exit status when the script file cannot be opened (python's own choice).
EXIT_NO_SCRIPT = 2

_HOOK_MARK = "_rewy_run_hook"


def add_arguments(parser) -> None:
    import argparse

    parser.add_argument("--backend", choices=BACKENDS, default="optimized",
                        help="optimized: patch every supported model (patch_model backend='auto'); "
                             "original: patch nothing, only report (default: optimized)")
    parser.add_argument("--policy", choices=POLICIES, default="recompute",
                        help="what the rewy backward keeps from the forward (default: recompute)")
    parser.add_argument("--fallback", choices=FALLBACKS, default="error",
                        help="calls rewy cannot serve: raise (error) or run the original core, "
                             "counted in the report (original) (default: error)")
    parser.add_argument("--report", metavar="OUT.json", default=None,
                        help="write the JSON report here (default: only a summary on stderr)")
    parser.add_argument("--allow-no-backward", action="store_true",
                        help="exit 0 even if no optimized backward ran (e.g. an evaluation script)")
    parser.add_argument("script", help="the Python script to run, unmodified")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to the script as sys.argv[1:]")


# --------------------------------------------------------------------------
# The post_init hook


@contextlib.contextmanager
def post_init_hook(callback: Callable[[Any], None]):
    """Wrap ``transformers.PreTrainedModel.post_init`` so that ``callback(model)``
    runs after it, for the duration of the block; restored on exit, also on error."""
    from transformers import PreTrainedModel

    missing = object()
    saved = PreTrainedModel.__dict__.get("post_init", missing)
    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        callback(self)
        return result

    setattr(post_init, _HOOK_MARK, True)
    PreTrainedModel.post_init = post_init
    try:
        yield
    finally:
        if saved is missing:
            with contextlib.suppress(AttributeError):
                delattr(PreTrainedModel, "post_init")
        else:
            PreTrainedModel.post_init = saved


class _ModelRecorder:
    """The post_init callback: patches (or, for `original`, only records) each new model.

    A composite model calls post_init for each submodel first (depth first),
    then for itself; only outermost models are reported, and layers patched
    by this run are not reported as ``already`` patched by the outer call.
    """

    def __init__(self, patch_options: dict | None):
        self.patch_options = patch_options        # None: record only
        self.entries: list[dict] = []             # {"ref", "model", "report"}
        self.our_layers: weakref.WeakSet = weakref.WeakSet()

    def __call__(self, model) -> None:
        report = None
        if self.patch_options is not None:
            from rewy_hf.patching import patch_model

            report = patch_model(model, strict=False, **self.patch_options)
            for p in report.patched:
                layer = model.get_submodule(p.name)
                if p.already and layer in self.our_layers:
                    p.already = False
                elif not p.already:
                    self.our_layers.add(layer)
        inner = {id(m) for m in model.modules() if m is not model}
        self.entries = [e for e in self.entries if e["ref"]() is None or id(e["ref"]()) not in inner]
        self.entries.append({"ref": weakref.ref(model), "model": type(model).__name__, "report": report})

    def models(self) -> list[str]:
        return [e["model"] for e in self.entries]

    def patched_models(self) -> list[dict]:
        out = []
        for e in self.entries:
            if e["report"] is not None and (e["report"].patched or e["report"].skipped):
                out.append({"model": e["model"], **e["report"].to_dict()})
        return out

    def unpatch(self) -> int:
        """Restore the layers this run patched that are still alive."""
        from rewy_hf.patching import unpatch_model

        restored = 0
        for layer in list(self.our_layers):
            restored += unpatch_model(layer, only={""})
        return restored


# --------------------------------------------------------------------------
# Running the script


@contextlib.contextmanager
def _script_environment(script: Path, argv: list[str]):
    saved_argv = sys.argv[:]
    folder = os.path.dirname(os.path.realpath(script))  # as python does for `python script.py`
    sys.argv = [str(script), *argv]
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        else:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)


def _script_traceback(exc: BaseException, script: Path) -> str:
    """The traceback from the script's first frame on, as python would print it."""
    tb = exc.__traceback__
    target = os.path.realpath(script)
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _exit_code(exc: SystemExit) -> tuple[int, str | None]:
    """Status and stderr message for ``sys.exit(code)``, as the interpreter maps them."""
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, bool):
        return int(code), None
    if isinstance(code, int):
        return code, None
    return 1, str(code)


def run_script(script: Path, argv: list[str]) -> tuple[int, str | None]:
    """Run ``script`` as __main__; returns (exit status, error text or None)."""
    with _script_environment(script, argv):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:
            status, message = _exit_code(exc)
            if message is not None:
                print(message, file=sys.stderr)
            return status, (None if status == 0 else f"SystemExit({exc.code!r})")
        except KeyboardInterrupt as exc:
            text = _script_traceback(exc, script)
            sys.stderr.write(text)
            return 130, text
        except BaseException as exc:  # noqa: BLE001 - the script's failure is our result
            text = _script_traceback(exc, script)
            sys.stderr.write(text)
            return 1, text
    return 0, None


# --------------------------------------------------------------------------
# Counting


def _diff_counts(before: dict, after: dict) -> dict:
    """Per-op difference of two dispatch reports: what ran during this run."""
    ops: dict[str, dict] = {}
    for op, now in after.get("ops", {}).items():
        then = before.get("ops", {}).get(op, {})
        entry: dict[str, Any] = {}
        for key, value in now.items():
            old = then.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                entry[key] = value - (old or 0)
            elif isinstance(value, dict):
                old = old or {}
                diff = {k: v - old.get(k, 0) if isinstance(v, int) else v for k, v in value.items()}
                entry[key] = {k: v for k, v in diff.items() if v}
            else:
                entry[key] = value
        if any(isinstance(v, int) and v for v in entry.values()):
            ops[op] = entry
    return {"ops": ops}


def _total(dispatch: dict, key: str) -> int:
    return sum(int(e.get(key, 0)) for e in dispatch.get("ops", {}).values())


def _no_backward_reason(report: dict) -> str:
    models = report["models_created"]
    patched = [m for m in report["patched_models"] if m["patched"]]
    dispatch = report["dispatch"]
    if not models:
        return "the script created no transformers/FLA model (PreTrainedModel.post_init never ran)"
    if not patched:
        return (f"none of the {len(models)} model(s) it created ({', '.join(sorted(set(models)))}) "
                "has a supported delta-rule layer")
    forwards, fallbacks = _total(dispatch, "forward_calls"), _total(dispatch, "fallback_calls")
    if not forwards and fallbacks:
        return f"all {fallbacks} delta-rule call(s) fell back to the original core"
    if not forwards:
        return "no patched layer ran a chunked forward (was the model run at all?)"
    return (f"{forwards} delta-rule forward(s) ran through rewy but none was followed by a backward "
            "(forward under torch.no_grad / inference only?)")


# --------------------------------------------------------------------------
# Summary


def _table(header: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*map(str, r)).rstrip() for r in rows]


def format_summary(report: dict) -> str:
    lines = [f"rewy-hf run: {report['script']} exited with status {report['script_exit_status']} "
             f"(backend={report['backend']}, policy={report['policy']}, fallback={report['fallback']})"]
    models = report["models_created"]
    if report["backend"] == "original":
        lines.append(f"models: {len(models)} created, none patched (backend=original)")
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
    elif report["backend"] != "original":
        lines.append("no delta-rule call went through rewy")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# The command


def run(args) -> int:
    import rewy_hf

    script = Path(args.script)
    argv = list(args.script_args or [])
    optimized = args.backend == "optimized"
    recorder = _ModelRecorder({"backend": "auto", "policy": args.policy, "fallback": args.fallback}
                              if optimized else None)
    # Resolved now: the script may chdir.
    report_path = Path(args.report).resolve() if args.report else None
    before = rewy_hf.dispatch_report()

    if not script.is_file():
        status = EXIT_NO_SCRIPT
        error = f"can't open file {str(script)!r}: no such file"
        print(f"rewy-hf run: {error}", file=sys.stderr)
    else:
        try:
            with post_init_hook(recorder):
                status, error = run_script(script, argv)
        finally:
            with contextlib.suppress(Exception):
                recorder.unpatch()
    after = rewy_hf.dispatch_report()
    script_status = status

    report: dict[str, Any] = {
        "backend": args.backend,
        "policy": args.policy,
        "fallback": args.fallback,
        "script": str(script),
        "argv": argv,
        "exit_status": status,
        "script_exit_status": script_status,
        "models_created": recorder.models(),
        "patched_models": recorder.patched_models(),
        "dispatch": _diff_counts(before, after),
        "error": error,
    }
    message = None
    if status == 0 and optimized and _total(report["dispatch"], "optimized_backward_calls") == 0:
        reason = _no_backward_reason(report)
        if args.allow_no_backward:
            message = f"rewy-hf run: note: no optimized backward ran: {reason} (allowed by --allow-no-backward)"
        else:
            status = EXIT_NO_BACKWARD
            message = (f"rewy-hf run: error: --backend optimized was asked but no optimized backward ran: {reason}. "
                       "Pass --allow-no-backward if the script is not meant to train, or --backend original "
                       f"to run it without rewy. Exiting with status {EXIT_NO_BACKWARD}.")
    report["exit_status"] = status

    print(format_summary(report), file=sys.stderr)
    if message:
        print(message, file=sys.stderr)
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"rewy-hf run: report written to {args.report}", file=sys.stderr)
    return status
