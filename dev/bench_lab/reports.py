"""Whole runs as text: ``--from-json`` prints the tables of kept --json files (``merge`` reads and
combines them) and draws their --plot; ``--markdown`` writes the same tables as Markdown, as docs/
publishes them, of a kept run or of the live run it was given to. An op-level run's tables include
those of this package's additions (``op_level``)."""

from __future__ import annotations

import sys

from rewy_hf.bench.plots import plot_unavailable
from rewy_hf.bench.runner import write_plot
from rewy_hf.bench.tables import (format_compile_result, format_model_result, format_op_tables, format_packed_result,
                                  op_base)

from .context_parallel import format_cp_rows
from .kernels import plot_kernels
from .merge import MergeError, as_report, merge_runs
from .op_level import lab_tables


def body(data: dict, markdown: bool) -> str:
    """The tables of a run of any kind."""
    kind, st = data["kind"], data.get("settings", {})
    if kind == "context_parallel":
        return format_cp_rows(data["rows"])
    if kind == "packed":
        return format_packed_result(data, markdown)
    if kind == "model":
        return (format_compile_result(data, st.get("model", "?"), markdown) if "sides" in data else
                format_model_result(data, st.get("model", "?"), st, markdown))
    return "\n\n".join(format_op_tables(data.get("rows", []), st.get("boundaries", []), op_base(data),
                                        data.get("device", "cuda"), markdown, more=lab_tables))


def report_text(data: dict) -> str:
    """What --from-json prints of a run."""
    if data.get("error") and not data.get("sides"):
        return f"that run could not run: {data['error']}"
    text = body(data, False) + ("\n" if data["kind"] == "ops" else "")
    if data.get("error"):
        text += f"\nthe run stopped after the sides above: {data['error']}"
    if isinstance(data.get("sources"), dict):      # joined model runs: what went wrong in any of them
        text += "".join(f"\nproblem: {p}" for p in data.get("problems", []))
    return text


def markdown_text(data: dict) -> str:
    """A whole run as --markdown writes it: the op and model levels under a line naming the device and
    versions (and the op level's timing, autotune and check), the packed and context-parallel tables bare."""
    if data.get("kind") in ("context_parallel", "packed"):
        return body(data, True) + "\n"
    st = data.get("settings", {})
    head = [f"Device: {data.get('device_name')}; "
            + ", ".join(f"{k} {x}" for k, x in data.get("versions", {}).items() if x) + ".", ""]
    if data.get("error"):
        return "\n".join(head + [f"This run could not run: {data['error']}"]) + "\n"
    if data.get("kind") != "model":
        head += [f"Timing: {st.get('timing')}.", ""]
        head += [f"Autotune: {st['autotune']}.", ""] if st.get("autotune") else []
        head += [f"Check: {st.get('check')}.", ""]
    tail = [] if data.get("complete", False) else ["", "(This run did not finish: these are the rows it wrote.)"]
    return "\n".join(head + [body(data, True)] + tail) + "\n"


def write_outputs(args, data: dict, out=None) -> None:
    """What this package adds to a finished run's outputs (its --json document, or runs ``merge``
    read): --markdown, and beside --plot the kernel figure of an op-level run that profiled them."""
    if data["kind"] in ("ops", "context_parallel") and data.get("rows") and isinstance(data["rows"][0], dict):
        data = as_report(data, "this run")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown_text(data))
        print(f"Markdown: {args.markdown}", file=out or sys.stdout)
    if args.plot and data["kind"] == "ops" and not data.get("error"):
        for path in plot_kernels(data, args.plot):
            print(f"kernel plot: {path}", file=out or sys.stdout)


def render(args) -> int:
    """--from-json: the tables (and plot, Markdown) of kept runs, with their exit status (2: the files
    could not be read as one report, or --plot without matplotlib)."""
    try:
        if args.plot and (reason := plot_unavailable()):
            raise MergeError(reason)
        data = merge_runs(args.from_json)
    except MergeError as exc:
        print(f"bench_lab: {exc}", file=sys.stderr)
        return 2
    print(report_text(data))
    if not data.get("complete", False):
        which = "one of these runs" if data.get("sources") else "that run"
        print(f"note: {which} did not finish (complete: false); these are the rows it wrote")
    write_outputs(args, data)
    if data["kind"] != "context_parallel":
        write_plot(args, data)
    elif args.plot:
        print("note: --context-parallel runs have a table and no plot")
    return int(data.get("exit_code", 1))
