"""dev/bench_lab --from-json on files that are not what a `rewy-hf bench` run writes: each is refused with exit 2
(1 would say a gradient check failed) and a message naming the file and what is wrong in it,
never a traceback, and never an empty table with exit 0."""

from __future__ import annotations

import json

import pytest

from bench_cli import run_lab

from rewy_hf import cli

TINY = ["--device", "cpu", "--shapes", "1,64,1,16,16", "--reps", "1", "--warmup", "0", "--op", "delta_rule",
        "--policy", "recompute"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The report of one tiny op-level run, as its --json wrote it."""
    path = tmp_path_factory.mktemp("from_json") / "run.json"
    assert cli.main(["bench", *TINY, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _edited(data: dict, edit):
    data = json.loads(json.dumps(data))
    edit(data)
    return data


def _drop_field(data, key):
    del data["rows"][0][key]


# (name, what the file holds, words the error must contain)
BAD = [
    ("list", lambda run: [run], ["holds a JSON list", "not a `rewy-hf bench --json` report"]),
    ("null", lambda run: None, ["holds a JSON null"]),
    ("no_rows", lambda run: _edited(run, lambda d: d.pop("rows")), ['has no "rows"']),
    ("rows_null", lambda run: _edited(run, lambda d: d.update(rows=None)), ['"rows" is a JSON null']),
    ("row_not_object", lambda run: _edited(run, lambda d: d.update(rows=["x"])), ["rows[0] is a JSON string"]),
    ("row_without_T", lambda run: _edited(run, lambda d: _drop_field(d, "T")), ["rows[0] has no T"]),
    ("row_without_op", lambda run: _edited(run, lambda d: _drop_field(d, "op")), ["rows[0] has no op"]),
    ("string_exit_code", lambda run: _edited(run, lambda d: d.update(exit_code="passed")),
     ["exit_code is 'passed', not a whole number"]),
    ("null_exit_code", lambda run: _edited(run, lambda d: d.update(exit_code=None)),
     ["exit_code is None, not a whole number"]),
    ("settings_without_boundaries", lambda run: _edited(run, lambda d: d["settings"].pop("boundaries")),
     ["its settings have no boundaries"]),
    ("empty_rows", lambda run: _edited(run, lambda d: d.update(rows=[])),
     ['has no rows ("rows": [])', "no verdict", "rerun the bench"]),
]


def test_the_unedited_report_renders(tiny_run, tmp_path, capsys):
    """The file the refusals below are edited from is one --from-json shows, with its exit status."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(tiny_run))
    code, out, err = run_lab(["--from-json", str(path)], capsys)
    assert code == 0, err
    assert "delta_rule, rewy policy recompute" in out and "geometric mean" in out


@pytest.mark.parametrize("name, content, words", BAD, ids=[b[0] for b in BAD])
def test_a_file_that_is_not_a_report_exits_2_naming_it(name, content, words, tiny_run, tmp_path, capsys):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(content(tiny_run)))
    code, out, err = run_lab(["--from-json", str(path)], capsys)
    assert code == 2, (out, err)
    assert f"--from-json {path}" in err, err
    for w in words:
        assert w in err, err
    assert "pass the file an earlier run wrote with --json" in err or "rerun the bench" in err
    assert "Traceback" not in err and out == ""


def test_among_several_files_the_bad_one_is_named(tiny_run, tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(tiny_run))
    bad.write_text(json.dumps(_edited(tiny_run, lambda d: _drop_field(d, "K"))))
    code, _, err = run_lab(["--from-json", str(good), str(bad)], capsys)
    assert code == 2 and f"--from-json {bad}: rows[0] has no K" in err


def test_runs_without_rows_are_refused_together_but_completed_by_a_run_with_them(tiny_run, tmp_path, capsys):
    """A run stopped before its first row wrote ``rows: []``: on its own, or beside another such
    run, there is nothing to show; beside a run of its configurations it combines into a complete
    report."""
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(_edited(tiny_run, lambda d: d.update(rows=[], complete=False, exit_code=1))))
    code, out, err = run_lab(["--from-json", str(cut), str(cut)], capsys)
    assert code == 2 and out == "" and f"none of {cut}, {cut} has a row" in err
    rest = tmp_path / "rest.json"
    rest.write_text(json.dumps(tiny_run))
    code, out, err = run_lab(["--from-json", str(cut), str(rest)], capsys)
    assert code == 0, err
    assert "delta_rule, rewy policy recompute" in out and "did not finish" not in out
