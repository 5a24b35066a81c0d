"""Kept `rewy-hf bench --json` files read back, several as one report (``--from-json a.json b.json ...``).

Op-level runs (one per op, per GPU, or a later run completing one cut short by a time limit) combine
into their rows in order; the result is complete if every file is, or if the rows together cover every
configuration any run asked for. Model runs split with ``--sides`` (four-sided or packed) combine into
their sides, each at most once. Files from different devices, versions or timing settings are refused,
since their rows could not share a table, and so is a configuration timed twice. The second gradient
checks concern their ops' rows only: rows of a checked op with and without the check do not combine."""

from __future__ import annotations

import json

from rewy_hf.bench.config import BOUND_CHECK, STRONG_CHECK
from rewy_hf.bench.rows import OpRow
from rewy_hf.kernels.vocabulary import POLICIES
from rewy_hf.op_inputs import BOUND_OPS, STRONG_OPS

from .context_parallel import CPRow
from .rows import op_row

# Settings that must agree for rows of different files to be compared.
# "check" is compared by _merged_check. The policies a run asked for are not among them:
# each row names its own policy, so a recompute-only run (--policy recompute) and a run
# of both combine, as long as no configuration is in both.
_SAME = ("boundaries", "backend", "qkv_dtype", "reps", "warmup", "rep_ms", "timing", "autotune")
# (clause appended to the check text, the ops it concerns, what a reader is told it checks)
_CLAUSES = (("; " + BOUND_CHECK, BOUND_OPS, "the KDA / GDN2 rows", "on gates near the safe lower bound"),
            ("; " + STRONG_CHECK, STRONG_OPS, "the GDN rows", "under strong decay"))


class MergeError(ValueError):
    pass


def _not_a_report(path: str, what: str, fix: str = "") -> MergeError:
    return MergeError(f"--from-json {path}{what}; pass the file an earlier run wrote with --json{fix}")


def load_run(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise _not_a_report(path, f": {exc}") from None
    return as_report(data, path)


def as_report(data, path: str) -> dict:
    """A run's --json document (read from ``path``) checked, with its rows as row objects."""
    if not isinstance(data, dict):
        raise _not_a_report(path, f" holds a JSON {_json_type(data)}, not a `rewy-hf bench --json` report (an "
                                  "object with kind, settings, ...)")
    if data.get("kind") not in ("ops", "model", "context_parallel", "packed") or not isinstance(data.get("settings"),
                                                                                                 dict):
        raise MergeError(f"--from-json {path} is not a `rewy-hf bench --json` file")
    code = data.get("exit_code", 1)
    # bool is an int to Python, but no run writes one: true/false there is an edited file
    if not isinstance(code, int) or isinstance(code, bool):
        raise _not_a_report(path, f": exit_code is {code!r}, not a whole number (0 passed, 1 a check failed, 2 "
                                  "could not run)", ", or fix that field")
    if data["kind"] in _ROW_FIELDS and not data.get("error"):
        _check_rows(path, data)
        read = op_row if data["kind"] == "ops" else CPRow.from_json
        data = {**data, "rows": [read(r) for r in data["rows"]]}
    return data


# What the tables (and combining runs) read of every row of a kind of run that has rows, and of its settings.
_ROW_FIELDS = {
    "ops": ("op", "policy", "B", "T", "H", "K", "V", "check_T", "check_reduced"),
    "context_parallel": ("op", "policy", "shape", "processes", "tokens_per_process", "ms", "peak_mb", "err",
                         "errors", "pass", "check_T"),
}
_SETTING_FIELDS = {"ops": ("ops", "policies", "boundaries", "shapes")}


def _json_type(value) -> str:
    return {list: "list", type(None): "null", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(value), type(value).__name__)


def _check_rows(path: str, data: dict) -> None:
    """MergeError naming ``path`` and what is wrong unless its rows are a list of rows of its kind. An
    empty list passes: a run stopped before its first row may still be completed by a later run."""
    if missing := [key for key in _SETTING_FIELDS.get(data["kind"], ()) if key not in data["settings"]]:
        raise _not_a_report(path, f": its settings have no {', '.join(missing)}")
    if "rows" not in data:
        raise _not_a_report(path, f": this {data['kind']} run has no \"rows\"")
    if not isinstance(rows := data["rows"], list):
        raise _not_a_report(path, f": \"rows\" is a JSON {_json_type(rows)}, not a list of rows")
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise _not_a_report(path, f": rows[{n}] is a JSON {_json_type(row)}, not an object")
        if missing := [key for key in _ROW_FIELDS[data["kind"]] if key not in row]:
            raise _not_a_report(path, f": rows[{n}] has no {', '.join(missing)}", ", or fix that row")


def _refuse_no_rows(paths: list[str], data: dict) -> None:
    """MergeError where the report to show has no rows: an empty table and exit 0 would read as a pass."""
    if data["kind"] in _ROW_FIELDS and not data.get("error") and not data["rows"]:
        which = f" {paths[0]} has no rows" if len(paths) == 1 else f": none of {', '.join(paths)} has a row"
        raise MergeError(f"--from-json{which} (\"rows\": []): nothing was timed or checked, so "
                         "there is no table to show and no verdict; rerun the bench (a run stopped before its first "
                         "configuration writes none)")


def merge_runs(paths: list[str]) -> dict:
    runs = [load_run(p) for p in paths]
    if len(runs) == 1:
        _refuse_no_rows(paths, runs[0])
        return runs[0]
    first = runs[0]
    if all(run["kind"] == "model" and "sides" in run for run in runs):
        return _merge_four_sided(paths, runs)
    if all(run["kind"] == "packed" for run in runs):
        return _merge_packed(paths, runs)
    for path, run in zip(paths[1:], runs[1:]):
        if run["kind"] != "ops" or first["kind"] != "ops":
            raise MergeError(f"--from-json: only op-level runs (not --context-parallel), or four-sided model runs "
                             f"(--compile), can be combined ({path} is a {run['kind']} run)")
        _refuse_other_setup(paths[0], first, path, run, "rows")
        for key in _SAME:
            if run["settings"].get(key) != first["settings"].get(key):
                raise MergeError(f"--from-json: {path} was timed with a different {key} than {paths[0]}: "
                                 f"{run['settings'].get(key)!r} vs {first['settings'].get(key)!r}")
    merged = {**first, "settings": {**first["settings"], "check": _merged_check(paths, runs)}, "rows": [],
              "sources": list(paths)}
    ops: list[str] = []
    for path, run in zip(paths, runs):
        merged["rows"] += run["rows"]
        ops += [op for op in run["settings"]["ops"] if op not in ops and any(r.op == op for r in run["rows"])]
    merged["settings"]["ops"] = ops
    merged["settings"]["policies"] = [p for p in POLICIES
                                      if any(p in run["settings"]["policies"] for run in runs)]
    # each file's rewy-hf settings (rewy_hf.settings), since runs of one table may have been timed under different ones
    merged["rewy_env"] = {path: run.get("rewy_env", {}) for path, run in zip(paths, runs)}
    _refuse_repeats([(r, path) for path, run in zip(paths, runs) for r in run["rows"]])
    merged["ok"] = all(r.ok for r in merged["rows"])
    if all(r.get("complete", False) for r in runs):
        merged["complete"] = True
        merged["exit_code"] = max(int(r.get("exit_code", 1)) for r in runs)
    else:
        merged["complete"] = _covers_requests(runs, merged["rows"])
        merged["exit_code"] = 0 if merged["complete"] and merged["ok"] else 1
    _refuse_no_rows(paths, merged)
    return merged


def _refuse_other_setup(first_path: str, first: dict, path: str, run: dict, what: str) -> None:
    """MergeError unless both runs ran and come from one device and one set of versions. A model run
    that failed after finishing some sides (a later side's error) still holds those sides."""
    for p, r in ((first_path, first), (path, run)):
        if r.get("error") and not (what == "sides" and r.get("sides")):
            raise MergeError(f"--from-json: a run that could not run has no {what} to combine ({p})")
    for key in ("device_name", "versions"):
        if run.get(key) != first.get(key):
            raise MergeError(f"--from-json: {path} has a different {key} than {first_path}: "
                             f"{run.get(key)!r} vs {first.get(key)!r}; combine runs of one setup only")


def _merge_sides(paths: list[str], runs: list[dict], order: tuple[str, ...], may_differ: tuple[str, ...],
                 which: str) -> dict:
    """Several model-level runs of some sides each as one: their sides in ``order``, each at most once,
    if the runs agree on the device, the versions and every setting but ``may_differ``."""
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:]):
        _refuse_other_setup(paths[0], first, path, run, "sides")
        for key in sorted(set(run["settings"]) | set(first["settings"])):
            if key not in may_differ and run["settings"].get(key) != first["settings"].get(key):
                raise MergeError(f"--from-json: {path} ran with a different {key} than {paths[0]}: "
                                 f"{run['settings'].get(key)!r} vs {first['settings'].get(key)!r}; only {which} "
                                 "combine")
    seen: dict[str, str] = {}
    for path, run in zip(paths, runs):
        for side in run.get("sides", {}):
            if side in seen:
                raise MergeError(f"--from-json: the {side} side is in both {seen[side]} and {path}; pass only one "
                                 "run of each side")
            seen[side] = path
    first = {k: v for k, v in first.items() if k != "error"}    # each run's error is one of the problems
    return {**first, "sides": {side: next(run["sides"][side] for run in runs if side in run.get("sides", {}))
                               for side in order if side in seen},
            "sources": {path: list(run.get("sides", {})) for path, run in zip(paths, runs)},
            "complete": all(run.get("complete", False) for run in runs),
            "problems": [p for run in runs for p in run.get("problems", [])]
            + [f"{path}: {run['error']}" for path, run in zip(paths, runs) if run.get("error")],
            "ok": all(run.get("ok", False) for run in runs),
            "exit_code": max(int(run.get("exit_code", 1)) for run in runs)}


def _merge_four_sided(paths: list[str], runs: list[dict]) -> dict:
    """Several `--model X --compile --sides ...` runs as one four-sided result. Each compiled side
    reports the further lengths it ran, so runs may differ in those too."""
    from rewy_hf.bench.compile_bench import SIDES, summarize

    merged = _merge_sides(paths, runs, SIDES, ("sides", "lengths"), "runs that differ in --sides and --lengths")
    asked = [side for side in SIDES if any(side in run["settings"].get("sides", SIDES) for run in runs)]
    lengths = list(dict.fromkeys(t for run in runs for t in run["settings"].get("lengths", [])))
    merged["settings"] = {**runs[0]["settings"], "sides": asked, "lengths": lengths}
    summarize(merged)
    return merged


def _merge_packed(paths: list[str], runs: list[dict]) -> dict:
    """Several `--model X --packed --sides ...` runs as one: their sides, and the documents check of
    the run that made one."""
    from rewy_hf.bench.packed_bench import ALL_SIDES, packed_summary

    merged = _merge_sides(paths, runs, ALL_SIDES, ("sides",), "packed runs that differ in --sides")
    checks = [run["documents_check"] for run in runs if "documents_check" in run]
    if len(checks) > 1:
        raise MergeError("--from-json: more than one of these packed runs made the documents check; pass one "
                         "(the others can run with --no-documents-check)")
    merged["settings"] = {**runs[0]["settings"], "sides": list(merged["sides"])}
    merged.pop("documents_check", None)
    if checks:
        merged["documents_check"] = checks[0]
    merged["summary"] = packed_summary(merged)
    return merged


def _merged_check(paths: list[str], runs: list[dict]) -> str:
    """The check every row of the combined report was held to, or MergeError."""
    texts = [run["settings"].get("check", "") for run in runs]
    present = [[clause in t for clause, *_ in _CLAUSES] for t in texts]
    mains = list(texts)
    for clause, *_ in _CLAUSES:
        mains = [m.replace(clause, "") for m in mains]
    for path, main in zip(paths[1:], mains[1:]):
        if main != mains[0]:
            raise MergeError(f"--from-json: {path} was checked differently than {paths[0]}: {main!r} vs {mains[0]!r}")
    merged = mains[0]
    for n, (clause, ops, rows, what) in enumerate(_CLAUSES):
        has = [(path, p[n]) for path, p, run in zip(paths, present, runs) if any(r.op in ops for r in run["rows"])]
        if any(h != has[0][1] for _, h in has):
            without = next(path for path, h in has if not h)
            with_ = next(path for path, h in has if h)
            raise MergeError(f"--from-json: {rows} of {without} were not checked {what}, those of {with_} were; "
                             f"combine runs of one rewy-hf version, or rerun {without}'s configurations")
        if (has and has[0][1]) or (not has and present[0][n]):
            merged += clause
    return merged


def _key(row: OpRow) -> tuple:
    s = row.shape
    return row.op, row.policy, s.B, s.T, s.H, s.K, s.V, s.N


def _refuse_repeats(rows: list[tuple[OpRow, str]]) -> None:
    """MergeError where two of the (row, the file it came from) are one configuration."""
    seen: dict[tuple, str] = {}
    for row, source in rows:
        if _key(row) in seen:
            op, policy, *shape = _key(row)
            raise MergeError(f"--from-json: {op} (policy {policy}) at B,T,H,K,V = {','.join(map(str, shape))} is in "
                             f"both {seen[_key(row)]} and {source}; pass only one run of each configuration")
        seen[_key(row)] = source


def _covers_requests(runs: list[dict], rows: list[OpRow]) -> bool:
    have = {_key(r) for r in rows}
    return all((op, policy, s["B"], s["T"], s["H"], s["K"], s["V"], s.get("N", 0)) in have
               for run in runs for op in run["settings"]["ops"] for policy in run["settings"]["policies"]
               for s in run["settings"]["shapes"])
