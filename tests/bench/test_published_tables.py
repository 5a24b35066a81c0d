"""docs/performance.md's per-shape tables, its summary and its FlashQLA forward + backward tables
are what `rewy-hf bench --from-json` makes of the kept bench files (docs/bench/), and the tables
computed from several files (FlashQLA's backward, KDA against TileLang, the README's op table, the
model-level step) follow those files, so an edited number, a table left behind after a rerun, or a summary that no longer
follows its tables fails here.

A section may add prose, "Source:" lines and notes between the generated tables, and it picks its
own heading levels; every generated table line and note (and, where the section carries it, the
command's header) must be in it, in the command's order, under the heading the command gives it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from rewy_hf.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"
SUMMARY_OPS = {"DeltaNet": "delta_rule", "GDN*": "gdn", "KDA": "kda", "GDN2": "gdn2"}


def _blocks(lines: list[str]) -> dict[str, list[str]]:
    """Heading text (without its #'s) -> the lines under it, up to the next heading; "" for the lines
    before the first heading."""
    out, key = {"": []}, ""
    for line in lines:
        if line.startswith("#"):
            key = line.lstrip("#").strip()
            out[key] = []
        else:
            out[key].append(line)
    return out


def _is_subsequence(needles: list[str], haystack: list[str]) -> bool:
    it = iter(haystack)
    return all(any(line == n for line in it) for n in needles)


def _section(doc: str, title: str) -> list[str]:
    """The lines of the section with this title, up to the next heading of its level or above."""
    head = re.search(rf"\n(#+) {re.escape(title)}\n", doc)
    assert head, f"performance.md has no section {title!r}"
    end = re.compile(rf"\n#{{1,{len(head.group(1))}}} ").search(doc, head.end())
    return doc[head.start():end.start() if end else None].splitlines()


# (kept files, the performance.md section that publishes their tables, the command's exit status,
# whether the section carries the command's header lines, how many tables it publishes). FlashQLA's
# files: the (4, 4096, 32) process stopped at its time limit before its `full` row, so the command
# says that one run did not finish (exit 1); the section publishes the tables against FLA as
# installed, not those of FlashQLA's own entry ("peers beside").
GROUPS = {
    "ops": ("ops/*.json", "Per-shape tables", 0, True, 8),
    "flashqla-fb": ("flashqla/gdn-peer-fb-*.json", "GDN against FlashQLA", 1, False, 2),
}


def _generate(tmp_path_factory, name: str) -> dict[str, list[str]]:
    pattern, _, status, _, _ = GROUPS[name]
    out = tmp_path_factory.mktemp("published") / f"{name}.md"
    files = sorted(str(p) for p in (DOCS / "bench").glob(pattern))
    assert files
    assert main(["bench", "--from-json", *files, "--markdown", str(out)]) == status
    return _blocks(out.read_text().splitlines())


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, list[str]]:
    return _generate(tmp_path_factory, "ops")


@pytest.mark.parametrize("name", GROUPS)
def test_every_generated_table_is_published_unchanged(tmp_path_factory, name):
    _, section, _, with_header, n_tables = GROUPS[name]
    generated = _generate(tmp_path_factory, name)
    published = _blocks(_section((DOCS / "performance.md").read_text(), section))
    kept = lambda lines: [x for x in lines if x.strip()]  # noqa: E731
    header = kept(generated[""])
    assert header and header[0].startswith("Device: ")
    if with_header:
        assert _is_subsequence(header, published[section]), "the header lines differ from the command's"
    tables = [k for k in generated if k and "peers beside" not in k]
    assert len(tables) == n_tables
    for title in tables:
        assert title in published, f"no table titled {title!r} in {section!r}"
        missing = [x for x in kept(generated[title]) if x not in published[title]]
        assert not missing, (title, missing[:3])
        assert _is_subsequence(kept(generated[title]), published[title]), f"{title}: lines out of order"


def _table(lines: list[str]) -> list[list[str]]:
    rows = [[c.strip() for c in x.strip().strip("|").split("|")] for x in lines if x.startswith("|")]
    return [r for r in rows if not set("".join(r)) <= set("-")]


def _first_table(section: str) -> list[list[str]]:
    """The cells of the first table in a section of performance.md, header row first."""
    lines = _section((DOCS / "performance.md").read_text(), section)
    first = next(i for i, x in enumerate(lines) if x.startswith("|"))
    end = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    return _table(lines[first:end])


def _summary_rows() -> dict[tuple[str, str], dict[str, str]]:
    head, *rows = _first_table("Summary")
    return {(SUMMARY_OPS[r[0]], r[1]): dict(zip(head, (c.strip("*") for c in r))) for r in rows}


def test_the_summary_follows_the_tables(generated):
    """Each summary row's speed-ups are its table's geometric-mean lines; its peak memory is the worst
    shape's rewy / FLA ratio; its gradient errors are the worst of each side's column."""
    summary = _summary_rows()
    assert len(summary) == 8
    for title, lines in generated.items():
        if not title:
            continue
        op, policy = re.match(r"(\w+), rewy policy (\w+) ", title).groups()
        head, *rows = _table(lines)
        col = {name.replace("*", ""): i for i, name in enumerate(head)}   # GDN's FLA* (timing only)
        shapes = [r for r in rows if not r[0].startswith("geometric mean")]
        mean = next(r for r in rows if r[0] == "geometric mean")
        fastest = next(r for r in rows if r[0] == "geometric mean, fastest rounds")
        s = summary[(op, policy)]
        assert s["B speed-up"] == mean[col["B speedup"]], (op, policy)
        assert s["B, fastest rounds"] == fastest[col["B speedup"]], (op, policy)
        assert s["FB speed-up"] == mean[col["FB speedup"]], (op, policy)
        worst = max(float(r[col["peak MB rewy"]]) / float(r[col["peak MB FLA"]]) for r in shapes)
        assert math.isclose(float(s["peak memory rewy / FLA"]), worst, abs_tol=0.005), (op, policy, worst)
        err_rewy, err_fla = (c.strip() for c in s["worst gradient error rewy / FLA"].split("/"))
        assert float(err_rewy) == max(float(r[col["err rewy"]]) for r in shapes), (op, policy)
        if err_fla != "timing only":
            assert float(err_fla) == max(float(r[col["err FLA"]]) for r in shapes), (op, policy)


def _rows(*names: str) -> dict[tuple[str, tuple[int, int, int]], dict]:
    out = {}
    for name in names:
        for r in json.loads((DOCS / "bench" / name).read_text())["rows"]:
            out[(r["policy"], (r["B"], r["T"], r["H"]))] = r
    return out


def test_the_flashqla_backward_table_follows_its_two_runs():
    """The first table of "GDN against FlashQLA" sets FlashQLA's backward (the baseline of the runs with
    flash-qla installed) against rewy's from the per-shape suite files, per policy; each ratio and
    the geometric means are computed from the files' times."""
    qla = _rows("flashqla/gdn-flashqla.json", "flashqla/gdn-flashqla-1_32768_32.json")
    rewy = _rows("ops/04-gdn-recompute-h16.json", "ops/05-gdn-recompute-h32.json", "ops/06-gdn-full.json")
    head, *rows = _first_table("GDN against FlashQLA")
    assert head[:6] == ["B,T,H", "FlashQLA B ms", "rewy recompute B ms", "speed-up recompute", "rewy full B ms",
                        "speed-up full"]
    ratios = {"recompute": [], "full": []}
    for r in rows[:-1]:
        shape = tuple(int(x) for x in r[0].split(","))
        q, rc, rf = qla[("recompute", shape)], rewy[("recompute", shape)], rewy[("full", shape)]
        assert r[1] == f"{q['baseline_B_ms']:.3f}" and r[2] == f"{rc['rewy_B_ms']:.3f}", r
        assert r[4] == f"{rf['rewy_B_ms']:.3f}", r
        for policy, col, mine in (("recompute", 3, rc), ("full", 5, rf)):
            ratio = qla[(policy, shape)]["baseline_B_ms"] / mine["rewy_B_ms"]
            assert r[col] == f"{ratio:.2f}x", (r, policy, ratio)
            ratios[policy].append(ratio)
        assert r[6] == f"{q['baseline_peak_mb']:.0f} / {rc['rewy_peak_mb']:.0f}", r
    assert len(rows) - 1 == 6 and rows[-1][0] == "geometric mean"
    for policy, col in (("recompute", 3), ("full", 5)):
        mean = math.exp(sum(map(math.log, ratios[policy])) / len(ratios[policy]))
        assert rows[-1][col].strip("*") == f"{mean:.2f}x", (policy, mean)


def test_the_kda_tilelang_table_follows_its_runs():
    """The table of "KDA against FLA with TileLang": FLA as installed is each run's baseline, FLA's
    Triton path its `fla-triton` peer, in the same process; every figure and ratio comes from the
    kept files (packed rows by their sequence count): the six bench shapes and 32k tokens packed from
    8 sequences, both policies."""
    runs = {}
    for path in sorted((DOCS / "bench" / "flashqla").glob("kda-tilelang-*.json")):
        for r in json.loads(path.read_text())["rows"]:
            runs[(r["B"], r["T"], r["H"], r["N"], r["policy"])] = r
    head, *rows = _first_table("KDA against FLA with TileLang")
    assert head[1:5] == ["policy", "FLA as installed (TileLang) B ms", "FLA Triton path B ms", "rewy B ms"]
    assert len(rows) == len(runs) == 14
    for r in rows:
        shape, _, packed = r[0].partition(", ")
        n = int(packed.split()[0]) if packed else 0
        run = runs[(*(int(x) for x in shape.split(",")), n, r[1])]
        triton_path = run["peers"]["fla-triton"]
        assert r[2:5] == [f"{run['baseline_B_ms']:.3f}", f"{triton_path['B_ms']:.3f}", f"{run['rewy_B_ms']:.3f}"], r
        assert r[5].strip("*") == f"{run['baseline_B_ms'] / run['rewy_B_ms']:.2f}x", r
        assert r[6] == f"{triton_path['B_ms'] / run['rewy_B_ms']:.2f}x", r
        assert r[7] == f"{run['baseline_peak_mb']:.0f} / {run['rewy_peak_mb']:.0f}", r
        assert r[8] == f"{run['err_baseline']:.1e} / {run['err_rewy']:.1e}", r
        assert run["ok"] and run["bound_ok"] and triton_path["err"] <= 1.1 * run["err_baseline"] + 1e-5, r


def test_the_readme_quotes_the_published_figures():
    """README's op table: DeltaNet, KDA and GDN2 as performance.md's summary gives them; GDN (marked *)
    from the rerun of GDN alone with its reverse state pass on rewy's walk (its kept file), by the
    same rules: geometric mean of the backward ratios, worst peak-memory ratio."""
    lines = (DOCS.parent / "README.md").read_text().splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("| op | `recompute` (default) |"))
    end = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    _, *rows = _table(lines[first:end])
    summary = _summary_rows()
    walk = json.loads((DOCS / "bench" / "walk" / "gdn-six-shapes.json").read_text())["rows"]
    names = {"DeltaNet": "delta_rule", "Gated DeltaNet (GDN)": "gdn", "Kimi Delta Attention (KDA)": "kda",
             "Gated DeltaNet-2 (GDN2)": "gdn2"}
    assert [r[0] for r in rows] == list(names)
    for name, recompute, full, peak in rows:
        op = names[name]
        quoted = {"recompute": recompute.rstrip("*"), "full": full.rstrip("*")}
        peaks = dict(zip(("recompute", "full"), (x.strip() for x in peak.split("/"))))
        for policy in ("recompute", "full"):
            if op == "gdn":
                rs = [r for r in walk if r["policy"] == policy]
                assert len(rs) == 6
                mean = math.exp(sum(math.log(r["baseline_B_ms"] / r["rewy_B_ms"]) for r in rs) / len(rs))
                worst = max(r["rewy_peak_mb"] / r["baseline_peak_mb"] for r in rs)
                assert quoted[policy] == f"{mean:.2f}x" and peaks[policy] == f"{worst:.2f}", (op, policy)
            else:
                s = summary[(op, policy)]
                assert quoted[policy] == s["B speed-up"], (op, policy)
                assert peaks[policy] == s["peak memory rewy / FLA"], (op, policy)


def _model_sides(preset: str) -> tuple[dict, dict]:
    sides = json.loads((DOCS / "bench" / "model" / f"eager-{preset}-h100.json").read_text())["sides"]
    return sides["unpatched eager"], sides["patched eager"]


def _tables(section: str) -> list[list[list[str]]]:
    """Every table of a section of performance.md, each as its cells, header row first."""
    lines, tables, i = _section((DOCS / "performance.md").read_text(), section), [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
            tables.append(_table(lines[i:end]))
            i = end
        else:
            i += 1
    return tables


def test_the_model_level_tables_follow_their_runs():
    """"Model level": the eager step table and the GPU time by kernel family come from the two ~1 B
    presets' kept eager runs: step medians, their ratio, peak memory, and each family's share of the
    unpatched step's profiled GPU time; README's patched eager rows quote the same runs."""
    presets = ("qwen3.5-gva-1b", "kimi-linear-1b")
    steps, families = _tables("Model level: one training step")[:2]
    assert [r[0].split()[0].strip("`") for r in steps[1:]] == list(presets)
    for r, preset in zip(steps[1:], presets):
        u, p = _model_sides(preset)
        assert r[1:6] == [f"{u['median_step_ms']:.1f} ms", f"{p['median_step_ms']:.1f} ms",
                          f"{u['median_step_ms'] / p['median_step_ms']:.3f}x",
                          f"{u['peak_mb']:,.0f} / {p['peak_mb']:,.0f}",
                          f"{100 * u['gpu_ms_by_family']['core'] / u['gpu_ms']:.1f} %"], (preset, r)
        assert p["dispatch"]["ops"] and all(op["fallback_calls"] == 0 for op in p["dispatch"]["ops"].values())
    names = {"elementwise": "elementwise", "GEMMs": "gemm", "short": "conv", "delta-rule": "core", "AdamW": "optimizer",
             "attention": "attention"}
    assert [c.strip("`") for c in families[0][1:]] == list(presets)
    for r in families[1:-1]:
        family = names[r[0].split()[0]]
        for cell, preset in zip(r[1:], presets):
            u, _ = _model_sides(preset)
            assert cell == f"{100 * u['gpu_ms_by_family'][family] / u['gpu_ms']:.1f} %", (preset, r)
    assert families[-1][1:] == [f"{_model_sides(p)[0]['gpu_ms']:.1f} ms" for p in presets]
    # the families cover the step: nothing is left out of the shares
    for preset in presets:
        u, _ = _model_sides(preset)
        assert len(families) - 2 == len(u["gpu_ms_by_family"])
        assert math.isclose(sum(u["gpu_ms_by_family"].values()), u["gpu_ms"], rel_tol=1e-6)
    readme = (DOCS.parent / "README.md").read_text().splitlines()
    for name, preset in (("Qwen3.5-like", "qwen3.5-gva-1b"), ("Kimi-Linear-like", "kimi-linear-1b")):
        row = next(_table([x])[0] for x in readme if x.startswith(f"| {name}") and ", eager" in x)
        u, p = _model_sides(preset)
        assert row[1:] == [f"{u['median_step_ms'] / p['median_step_ms']:.2f}x",
                           f"{p['peak_mb'] / u['peak_mb']:.2f}"], (preset, row)


def test_the_gdn2_packed_table_follows_its_run():
    """"Packed input": GDN2's packed rows are its kept run's medians, peaks and gradient errors."""
    rows = _rows("packed/gdn2-split-launch-h100.json")
    table = next(t for t in _tables("Packed input: full chunks and short chunks in two launches")
                 if t[0][0] == "policy")
    assert [r[0] for r in table[1:]] == ["recompute", "full"]
    for policy, fla, rewy, speedup, peak, err, bound in table[1:]:
        r = rows[(policy, (1, 32768, 32))]
        assert r["ok"] and r["bound_ok"] and r["N"] == 8
        assert [fla, rewy] == [f"{r['baseline_B_ms']:.3f}", f"{r['rewy_B_ms']:.3f}"], policy
        assert speedup == f"{r['baseline_B_ms'] / r['rewy_B_ms']:.2f}x", policy
        assert peak == f"{r['baseline_peak_mb']:.0f} / {r['rewy_peak_mb']:.0f}", policy
        assert err == f"{r['err_baseline']:.1e} / {r['err_rewy']:.1e}", policy
        assert bound == f"{r['bound_err_baseline']:.1e} / {r['bound_err_rewy']:.1e}", policy
