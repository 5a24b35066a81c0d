"""The published figures follow the kept bench files (docs/bench/).

docs/per-shape.md's tables, the FlashQLA forward + backward tables of docs/studies.md, and the
generated tables of docs/performance.md (what serves a patched GDN call with flash-qla installed, the
end-to-end compile steps, packed fine-tuning) and of docs/studies.md (further lengths, two further
presets) are what the developer bench's `--from-json` (dev/bench_lab) makes of their files. The
tables and figures computed from several files or from a file's raw rows (performance.md's summary and
its GDN note, FlashQLA's backward, KDA against TileLang, the model-level step, the notes under the
per-shape tables, GDN2's packed row in studies.md) are recomputed here. So an edited number, a table
left behind after a rerun, or a summary that no longer follows its tables fails here. README.md and the
guides copy none of these figures: they link to them.

A section may add prose, "Source:" lines and notes between the generated tables, and it picks its
own heading levels; every generated table line and note (and, where the section carries it, the
command's header) must be in it, in the command's order, under the heading the command gives it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from bench_cli import lab_main

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SUMMARY_OPS = {"DeltaNet": "delta_rule", "GDN*": "gdn", "KDA": "kda", "GDN2": "gdn2"}


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


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


def _section(page: str, title: str) -> list[str]:
    """The lines of the section of docs/<page> with this title, up to the next heading of its level
    or above."""
    doc = "\n" + (DOCS / page).read_text()
    head = re.search(rf"\n(#+) {re.escape(title)}\n", doc)
    assert head, f"{page} has no section {title!r}"
    end = re.compile(rf"\n#{{1,{len(head.group(1))}}} ").search(doc, head.end())
    return doc[head.start() + 1:end.start() if end else None].splitlines()


def _prose(page: str, title: str) -> str:
    """A section's text with every run of whitespace made one space, so that figures can be looked
    for across line breaks."""
    return " ".join(" ".join(_section(page, title)).split())


def _markdown(tmp_path_factory, files: list[str], status: int) -> str:
    """`dev/bench_lab --from-json FILES --markdown OUT`, given the files as the repository root's
    relative paths (as the pages write the command), and the Markdown it writes."""
    out = tmp_path_factory.mktemp("published") / "out.md"
    paths = [str(DOCS / "bench" / f) for f in files]
    assert all(Path(p).is_file() for p in paths), files
    assert lab_main(["--from-json", *paths, "--markdown", str(out)]) == status
    return out.read_text().replace(f"{ROOT}/", "")


# Generated tables under headings: (kept files, the page and section that publish them, the command's
# exit status, whether the section carries the command's header lines, how many tables it publishes,
# the titles of the command's tables the section leaves out). FlashQLA's forward + backward files: the
# (4, 4096, 32) process reached the 10-minute limit of one benchmark command before its `full` row, so
# the command says that one run did not finish (exit 1); the sections publish the tables against FLA as
# installed, not those of FlashQLA's own entry ("peers beside") or the kernel tables.
GROUPS = {
    "ops": ("ops/*.json", "per-shape.md", "Per-shape tables", 0, True, 8, ()),
    "flashqla-fb": ("flashqla/gdn-peer-fb-*.json", "studies.md", "GDN against FlashQLA: forward + backward", 1,
                    False, 2, ("peers beside",)),
    "flashqla-auto": ("flashqla/gdn-auto-split.json", "studies.md",
                      "What serves a patched GDN call where flash-qla is installed", 0, False, 1,
                      ("peers beside", "kernels of one")),
}


def _generate(tmp_path_factory, name: str) -> dict[str, list[str]]:
    pattern, _, _, status, _, _, _ = GROUPS[name]
    files = sorted(str(p.relative_to(DOCS / "bench")) for p in (DOCS / "bench").glob(pattern))
    assert files
    return _blocks(_markdown(tmp_path_factory, files, status).splitlines())


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, list[str]]:
    return _generate(tmp_path_factory, "ops")


@pytest.mark.parametrize("name", GROUPS)
def test_every_generated_table_is_published_unchanged(tmp_path_factory, name):
    _, page, section, _, with_header, n_tables, left_out = GROUPS[name]
    generated = _generate(tmp_path_factory, name)
    published = _blocks(_section(page, section))
    kept = lambda lines: [x for x in lines if x.strip()]  # noqa: E731
    header = kept(generated[""])
    assert header and header[0].startswith("Device: ")
    if with_header:
        assert _is_subsequence(header, published[section]), "the header lines differ from the command's"
    tables = [k for k in generated if k and not any(s in k for s in left_out)]
    assert len(tables) == n_tables
    for title in tables:
        assert title in published, f"no table titled {title!r} in {section!r}"
        missing = [x for x in kept(generated[title]) if x not in published[title]]
        assert not missing, (title, missing[:3])
        assert _is_subsequence(kept(generated[title]), published[title]), f"{title}: lines out of order"


# Generated model-level output, published verbatim as one block: (kept files, page, section, the
# command's exit status). Runs that reached the 10-minute limit of one benchmark command exit 1.
STEP_TABLES = {
    "compile-qwen": (["model/compile-qwen3.5-gva-1b-corpus.json"], "performance.md",
                     "End-to-end: torch.compile", 0),
    "compile-kimi": (["model/compile-kimi-linear-1b-corpus.json", "model/compile-kimi-linear-1b-corpus-compiled.json"],
                     "performance.md", "End-to-end: torch.compile", 1),
    "packed": (["packed/qwen35-248k-unpatched-h100.json", "packed/qwen35-248k-patched-compiled-h100.json"],
               "performance.md", "Packed fine-tuning at a real vocabulary", 1),
    "packed-eager": (["packed/qwen35-248k-unpatched-eager-30-steps-h100.json",
                      "packed/qwen35-248k-patched-eager-fused-parts-h100.json"], "performance.md",
                     "Packed fine-tuning at a real vocabulary", 1),
    "packed-kimi": (["packed/kimi-164k-unpatched-eager-h100.json", "packed/kimi-164k-patched-h100.json"],
                    "performance.md", "Packed fine-tuning at a real vocabulary", 1),
    "packed-kimi-compiled": (["packed/kimi-164k-unpatched-eager-h100.json",
                              "packed/kimi-164k-patched-compiled-h100.json"],
                             "performance.md", "Packed fine-tuning at a real vocabulary", 1),
    "packed-liger": (["packed/qwen35-248k-unpatched-eager-and-liger-h100.json",
                      "packed/qwen35-248k-patched-liger-h100.json"],
                     "performance.md", "Packed fine-tuning at a real vocabulary", 1),
    "lengths-qwen": (["model/compile-qwen3.5-gva-1b-corpus-mix-order-non-strict.json"], "studies.md",
                     "Further lengths", 0),
    "lengths-kimi": (["model/compile-kimi-linear-1b-corpus-mix-order-non-strict.json"], "studies.md",
                     "Further lengths", 0),
    "preset-qwen3.5-1b": (["model/qwen3.5-1b.json"], "studies.md", "Model level: two further presets", 0),
    "preset-gdn2-1b": (["model/gdn2-1b.json"], "studies.md", "Model level: two further presets", 0),
}


@pytest.mark.parametrize("name", STEP_TABLES)
def test_every_generated_step_table_is_published_verbatim(tmp_path_factory, name):
    files, page, section, status = STEP_TABLES[name]
    block = _markdown(tmp_path_factory, files, status).strip()
    assert "\n|---|" in block, "the command wrote no table"
    assert block in "\n".join(_section(page, section)), f"{name}: {page} {section!r} differs from the command's output"


def _table(lines: list[str]) -> list[list[str]]:
    rows = [[c.strip() for c in x.strip().strip("|").split("|")] for x in lines if x.startswith("|")]
    return [r for r in rows if not set("".join(r)) <= set("-")]


def _tables(page: str, section: str) -> list[list[list[str]]]:
    """Every table of a section, each as its cells, header row first."""
    lines, tables, i = _section(page, section), [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
            tables.append(_table(lines[i:end]))
            i = end
        else:
            i += 1
    return tables


def _summary_rows() -> dict[tuple[str, str], dict[str, str]]:
    head, *rows = _tables("performance.md", "Summary")[0]
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


def _all_rows(pattern: str) -> list[dict]:
    return [r for p in sorted((DOCS / "bench").glob(pattern)) for r in json.loads(p.read_text())["rows"]]


def test_every_suite_row_passes_as_the_terms_say():
    rows = _all_rows("ops/*.json")
    assert all(r["ok"] and r.get("bound_ok", True) for r in rows)
    assert f"All {len(rows)} rows pass." in _prose("performance.md", "Performance")


def test_the_gdn_note_follows_the_walk_rerun():
    """The note under the summary: GDN's backward alone with rewy's reverse walk, six shapes, from its
    kept file: geometric means of the median, fastest-round and summed-kernel-time ratios, and the
    worst peak-memory ratio, per policy."""
    rows = json.loads((DOCS / "bench" / "walk" / "gdn-six-shapes.json").read_text())["rows"]
    figures = {}
    for policy in ("recompute", "full"):
        rs = [r for r in rows if r["policy"] == policy and r["op"] == "gdn"]
        assert len(rs) == 6 and all(r["ok"] for r in rs)
        kernels = lambda k: sum(v["ms"] for v in k.values())  # noqa: E731
        figures[policy] = (
            f"{_geomean(r['baseline_B_ms'] / r['rewy_B_ms'] for r in rs):.2f}x",
            f"{_geomean(min(r['baseline_B_rounds']) / min(r['rewy_B_rounds']) for r in rs):.2f}x",
            f"{_geomean(kernels(r['baseline_kernels_B']) / kernels(r['rewy_kernels_B']) for r in rs):.2f}x",
            f"{max(r['rewy_peak_mb'] / r['baseline_peak_mb'] for r in rs):.2f}")
    (m_r, f_r, k_r, p_r), (m_f, f_f, k_f, p_f) = figures["recompute"], figures["full"]
    expected = (f"recompute / full: {m_r} / {m_f} by medians, {f_r} / {f_f} by fastest rounds, {k_r} / {k_f} by "
                f"the summed kernel time of one backward per side, and a peak memory of {p_r} / {p_f} of FLA's: its "
                f"`full` peaks where its `recompute` does, one value-sized bf16 tensor below the suite's `full` rows "
                f"({_full_gap(rows, (8, 2048, 16)):.0f} MB at (8, 2048, 16), {_full_gap(rows, (1, 32768, 32)):.0f} MB at "
                f"(1, 32768, 32)).")
    assert expected in _prose("performance.md", "Summary")
    for r in rows:                  # the rerun's full peaks no higher than its recompute at the same shape
        twin = next(x for x in rows if x["policy"] == "recompute" and (x["B"], x["T"], x["H"]) == (r["B"], r["T"], r["H"]))
        assert r["rewy_peak_mb"] <= twin["rewy_peak_mb"]


def _full_gap(rerun: list[dict], shape: tuple[int, int, int]) -> float:
    """The suite's `full` peak minus the rerun's at ``shape`` (MB), checked to be one bf16 [B, T, HV, V]
    tensor, V = 128, within 15 %."""
    suite = next(r for r in _all_rows("ops/06-gdn-full.json") if (r["B"], r["T"], r["H"]) == shape)
    again = next(r for r in rerun if r["policy"] == "full" and (r["B"], r["T"], r["H"]) == shape)
    gap = suite["rewy_peak_mb"] - again["rewy_peak_mb"]
    B, T, H = shape
    assert abs(gap - B * T * H * 128 * 2 / 2 ** 20) <= 0.15 * B * T * H * 128 * 2 / 2 ** 20
    return gap


def test_the_notes_under_the_per_shape_tables_follow_their_files():
    """DeltaNet recompute at (2, 8192, 16): each side's range of rounds; KDA full at (1, 16384, 16):
    the row timed alone, and the six-shape mean with it in place of the suite's row."""
    page = _prose("per-shape.md", "Per-shape tables")
    row = next(r for r in _all_rows("ops/0[12]-delta_rule-*.json")
               if (r["B"], r["T"], r["H"]) == (2, 8192, 16) and r["policy"] == "recompute")
    rewy, fla = row["rewy_B_rounds"], row["baseline_B_rounds"]
    assert (f"(rewy's {len(rewy)} rounds {min(rewy):.2f}-{max(rewy):.2f} ms, FLA's {min(fla):.2f}-{max(fla):.2f} ms)"
            .replace("5 rounds", "five rounds") in page)
    assert row["rewy_B_ms"] > row["baseline_B_ms"]   # the row the note explains is below 1
    alone = json.loads((DOCS / "bench" / "kda-full-1_16384_16.json").read_text())["rows"]
    assert len(alone) == 1 and alone[0]["policy"] == "full" and alone[0]["ok"]
    a = alone[0]
    assert f"FLA {a['baseline_B_ms']:.3f} ms, rewy {a['rewy_B_ms']:.3f} ms, {a['baseline_B_ms'] / a['rewy_B_ms']:.2f}x" in page
    suite = [r for r in _all_rows("ops/0[789]-kda-*.json")
             if r["policy"] == "full" and (r["B"], r["T"], r["H"]) != (1, 16384, 16)]
    assert len(suite) == 5
    mean = _geomean([r["baseline_B_ms"] / r["rewy_B_ms"] for r in suite] + [a["baseline_B_ms"] / a["rewy_B_ms"]])
    assert f"the six-shape mean stays {mean:.2f}x" in page


def _rows(*names: str) -> dict[tuple[str, tuple[int, int, int]], dict]:
    out = {}
    for name in names:
        for r in json.loads((DOCS / "bench" / name).read_text())["rows"]:
            out[(r["policy"], (r["B"], r["T"], r["H"]))] = r
    return out


def test_the_flashqla_backward_table_follows_its_two_runs():
    """The first table of "GDN against FlashQLA" sets FlashQLA's backward (the baseline of the runs with
    flash-qla installed) against rewy's from the per-shape suite files, per policy; each ratio and
    the geometric means are computed from the files' times, and so are the shapes the bullets count."""
    qla = _rows("flashqla/gdn-flashqla.json", "flashqla/gdn-flashqla-1_32768_32.json")
    rewy = _rows("ops/04-gdn-recompute-h16.json", "ops/05-gdn-recompute-h32.json", "ops/06-gdn-full.json")
    head, *rows = _tables("performance.md", "GDN against FlashQLA")[0]
    assert head[:6] == ["B,T,H", "FlashQLA B ms", "rewy recompute B ms", "speed-up recompute", "rewy full B ms",
                        "speed-up full"]
    ratios = {"recompute": {}, "full": {}}
    for r in rows[:-1]:
        shape = tuple(int(x) for x in r[0].split(","))
        q, rc, rf = qla[("recompute", shape)], rewy[("recompute", shape)], rewy[("full", shape)]
        assert r[1] == f"{q['baseline_B_ms']:.3f}" and r[2] == f"{rc['rewy_B_ms']:.3f}", r
        assert r[4] == f"{rf['rewy_B_ms']:.3f}", r
        for policy, col, mine in (("recompute", 3, rc), ("full", 5, rf)):
            ratio = qla[(policy, shape)]["baseline_B_ms"] / mine["rewy_B_ms"]
            assert r[col] == f"{ratio:.2f}x", (r, policy, ratio)
            ratios[policy][shape] = ratio
        assert r[6] == f"{q['baseline_peak_mb']:.0f} / {rc['rewy_peak_mb']:.0f}", r
        assert q["baseline_peak_mb"] < rc["rewy_peak_mb"], r     # "FlashQLA peaks below rewy's memory"
    assert len(rows) - 1 == 6 and rows[-1][0] == "geometric mean"
    for policy, col in (("recompute", 3), ("full", 5)):
        assert rows[-1][col].strip("*") == f"{_geomean(ratios[policy].values()):.2f}x", policy
    text = _prose("performance.md", "GDN against FlashQLA")
    slower = sum(x < 1 for x in ratios["recompute"].values())
    assert f"rewy `recompute` is slower at {['no', 'one', 'two', 'three', 'four', 'five', 'six'][slower]} of six" in text
    assert [s for s, x in ratios["recompute"].items() if x > 1] == [(2, 8192, 16)]
    assert sorted(s for s, x in ratios["full"].items() if x > 1) == [(2, 8192, 16), (4, 4096, 16)]


def test_the_kda_tilelang_table_follows_its_runs():
    """The table of KDA against TileLang (studies.md): FLA as installed is each run's baseline, FLA's
    Triton path its `fla-triton` peer, in the same process; every figure and ratio comes from the
    kept files (packed rows by their sequence count): the six bench shapes and 32k tokens packed from
    8 sequences, both policies; so do the six-shape means of performance.md's "KDA against FLA with
    TileLang"."""
    runs = {}
    for path in sorted((DOCS / "bench" / "flashqla").glob("kda-tilelang-*.json")):
        for r in json.loads(path.read_text())["rows"]:
            runs[(r["B"], r["T"], r["H"], r["N"], r["policy"])] = r
    head, *rows = _tables("studies.md", "KDA against TileLang, kernel by kernel")[0]
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
        assert triton_path["B_ms"] > run["baseline_B_ms"] > run["rewy_B_ms"], r   # TileLang faster; rewy ahead
    means = {}
    for policy in ("recompute", "full"):
        six = [r for (_, _, _, n, p), r in runs.items() if p == policy and n == 0]
        assert len(six) == 6
        means[policy] = (f"{_geomean(r['baseline_B_ms'] / r['rewy_B_ms'] for r in six):.2f}x",
                         f"{_geomean(r['peers']['fla-triton']['B_ms'] / r['rewy_B_ms'] for r in six):.2f}x")
    expected = (f"Six-shape geometric mean against FLA as installed: **{means['recompute'][0]}** (recompute) and "
                f"**{means['full'][0]}** (full); against its Triton path {means['recompute'][1]} and {means['full'][1]}.")
    assert expected in _prose("performance.md", "KDA against FLA with TileLang")


def test_the_readme_and_the_guides_link_to_the_figures_instead_of_copying_them():
    """Each figure lives on one page: README.md and the guides carry no speed-up and no table of bench
    figures, and README.md links to performance.md's summary and to the sections it describes."""
    pages = [ROOT / "README.md", *(DOCS / p for p in ("usage.md", "bench.md", "architecture.md", "compatibility.md",
                                                        "run.md"))]
    for page in pages:
        text = page.read_text()
        copied = re.findall(r"\b\d+\.\d+x\b", text)
        assert not copied, f"{page.name} quotes speed-ups {copied[:3]}: link to the section that owns them"
        heads = [x.lower() for x in text.splitlines() if x.startswith("|") and ("speed" in x.lower() or " ms" in x)]
        assert not heads, f"{page.name} has a table of bench figures: {heads[0]}"
    readme = (ROOT / "README.md").read_text()
    for anchor in ("summary", "model-level-one-training-step", "end-to-end-torchcompile", "gdn-against-flashqla"):
        assert f"(docs/performance.md#{anchor})" in readme, anchor


def _model_sides(preset: str, run: str = "h100") -> tuple[dict, dict]:
    sides = json.loads((DOCS / "bench" / "model" / f"eager-{preset}-{run}.json").read_text())["sides"]
    return sides["unpatched eager"], sides["patched eager"]


def test_the_model_level_tables_follow_their_runs():
    """"Model level": the eager step table and the GPU time by kernel family come from the two ~1 B
    presets' kept eager runs: step medians, their ratio, peak memory, the core's share of the
    unpatched step, each family's GPU time on both sides; and so do the figures of the prose around
    them (each side's range of steps, the routed calls, the peak differences, the first losses, the
    convolution's share of the patched step)."""
    presets = ("qwen3.5-gva-1b", "kimi-linear-1b")
    steps, families = _tables("performance.md", "Model level: one training step")[:2]
    assert [r[0].split()[0].strip("`") for r in steps[1:]] == list(presets)
    text = _prose("performance.md", "Model level: one training step")
    for r, preset in zip(steps[1:], presets):
        u, p = _model_sides(preset)
        assert r[1:6] == [f"{u['median_step_ms']:.1f} ms", f"{p['median_step_ms']:.1f} ms",
                          f"{u['median_step_ms'] / p['median_step_ms']:.3f}x",
                          f"{u['peak_mb']:,.0f} / {p['peak_mb']:,.0f}",
                          f"{100 * u['gpu_ms_by_family']['core'] / u['gpu_ms']:.1f} %"], (preset, r)
        ops = p["dispatch"]["ops"]
        assert all(op["fallback_calls"] == 0 for op in ops.values())
        # the delta-rule cores run rewy's backward on every call; the layer parts are forward routes
        cores = [op for name, op in ops.items() if name not in ("short_conv", "gated_norm", "forget_gate")]
        assert len(cores) == 1 and cores[0]["forward_calls"] == cores[0]["optimized_backward_calls"] > 0
        calls = cores[0]["forward_calls"]
        assert f"({calls} of {calls} per model, no fallback)" in text
        assert ops["short_conv"]["backends"] == {"fla-gluon": calls}, preset
        assert ops["gated_norm"]["forward_calls"] == calls, preset
        assert ("forget_gate" in ops) == (preset == "kimi-linear-1b"), preset
        spans = [f"{min(s['step_ms']):.1f}-{max(s['step_ms']):.1f}" for s in (u, p)]
        assert f"{spans[0]} against {spans[1]} ms" in text, (preset, spans)
        assert max(p["step_ms"]) < min(u["step_ms"]), preset   # the sides' steps do not overlap: a measured gain
        assert p["peak_mb"] < u["peak_mb"], preset
        assert f"{u['peak_mb'] - p['peak_mb']:,.0f} MB below" in text, preset
        assert f"{p['first_loss_rel_diff']:.1e}".replace("e-0", "e-") in text, preset
    shares = " and ".join(f"{100 * (p := _model_sides(m)[1])['gpu_ms_by_family']['conv'] / p['gpu_ms']:.1f} %"
                          for m in presets)
    assert shares in " ".join(text.split()), shares
    names = {"elementwise": "elementwise", "GEMMs": "gemm", "short": "conv", "delta-rule": "core", "AdamW": "optimizer",
             "attention": "attention"}
    assert [c.strip("`") for c in families[0][1:]] == list(presets)
    for r in families[1:-1]:
        family = names[r[0].split()[0]]
        for cell, preset in zip(r[1:], presets):
            u, p = _model_sides(preset)
            assert cell == f"{u['gpu_ms_by_family'][family]:.1f} / {p['gpu_ms_by_family'][family]:.1f}", (preset, r)
    assert families[-1][1:] == [" / ".join(f"{s['gpu_ms']:.1f}" for s in _model_sides(p)) for p in presets]
    # the families cover the step: nothing is left out of the table
    for preset in presets:
        for side in _model_sides(preset):
            assert len(families) - 2 == len(side["gpu_ms_by_family"])
            assert math.isclose(sum(side["gpu_ms_by_family"].values()), side["gpu_ms"], rel_tol=1e-6)
    # the figures before the layer parts, which the prose quotes
    for preset in presets:
        u, p = _model_sides(preset, "before-fused-parts-h100")
        assert f"{u['median_step_ms'] / p['median_step_ms']:.3f}x" in text, preset


def test_the_gdn2_packed_table_follows_its_run():
    """studies.md, "Packed input": GDN2's packed rows are its kept run's medians, peaks and gradient errors."""
    rows = _rows("packed/gdn2-split-launch-h100.json")
    table = next(t for t in _tables("studies.md", "Packed input: full chunks and short chunks in two launches")
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


def _packed_run(file: str) -> dict:
    return json.loads((DOCS / "bench" / "packed" / file).read_text())


def _packed_sides(*files: str) -> dict[str, dict]:
    sides = {}
    for f in files:
        sides.update(_packed_run(f)["sides"])
    return sides


def test_the_packed_notes_follow_their_runs():
    """performance.md, "Packed fine-tuning": the figures of the notes under the tables are the kept
    runs' ratios, shares and spikes."""
    text = _prose("performance.md", "Packed fine-tuning at a real vocabulary")
    q = _packed_sides("qwen35-248k-unpatched-h100.json", "qwen35-248k-patched-compiled-h100.json")
    qe = _packed_sides("qwen35-248k-unpatched-eager-30-steps-h100.json",
                       "qwen35-248k-patched-eager-fused-parts-h100.json")
    k = _packed_sides("kimi-164k-unpatched-eager-h100.json", "kimi-164k-patched-h100.json")
    kc = _packed_sides("kimi-164k-unpatched-eager-h100.json", "kimi-164k-patched-compiled-h100.json")
    speed = lambda s, a, b: s[a]["tokens_per_s"] / s[b]["tokens_per_s"]  # noqa: E731
    peak = lambda s, a, b: s[a]["peak_mb"] / s[b]["peak_mb"]  # noqa: E731
    u, pe, pc = "unpatched eager", "patched eager", "patched compiled"
    flat = " ".join(text.split())
    assert (f"{speed(q, pc, u):.2f}x the unpatched eager tokens/s at {peak(q, pc, u):.2f} of its peak memory"
            in flat)
    assert f"{speed(kc, pc, u):.2f}x at {peak(kc, pc, u):.2f} (Kimi-Linear-like)" in flat
    assert f"**Patched eager**: {speed(qe, pe, u):.2f}x and {speed(k, pe, u):.2f}x at lower peak memory" in flat
    assert qe[pe]["peak_mb"] < qe[u]["peak_mb"] and k[pe]["peak_mb"] < k[u]["peak_mb"]
    # the compiled Kimi-Linear run's one slow step: the first one-document row, building kernels
    slow = kc[pc]["step_ms"].index(kc[pc]["max_step_ms"])
    assert _packed_run("kimi-164k-patched-compiled-h100.json")["documents_per_step"][slow] == 1 and f"step {slow + 1}, the first row of one document" in flat
    builds = kc[pc]["triton_builds_per_step"]
    assert sum(builds) == builds[slow] and f"({kc[pc]['max_step_ms'] / 1e3:.1f} s, step {slow + 1}" in flat
    assert f"built {builds[slow]} Triton kernels" in flat
    fam = lambda s, side, f: s[side]["gpu_ms_by_family"][f]  # noqa: E731
    share = 100 * fam(qe, pe, "conv") / qe[pe]["gpu_ms"]
    assert f"({fam(qe, pe, 'conv'):.1f} against {fam(qe, u, 'conv'):.1f} GPU ms, {share:.1f} % of the step)" in text
    assert (f"(elementwise {fam(qe, pe, 'elementwise'):.1f} against {fam(qe, u, 'elementwise'):.1f} and "
            f"{fam(k, pe, 'elementwise'):.1f} against {fam(k, u, 'elementwise'):.1f} ms)") in text
    # every eager side of these runs (new machines, Triton's cache empty or partial) pays once at step 7,
    # the first row of one document
    extra = [s["max_step_ms"] - s["median_step_ms"] for s in (qe[u], qe[pe], k[u], k[pe])]
    assert all(s["step_ms"].index(s["max_step_ms"]) == 6 for s in (qe[u], qe[pe], k[u], k[pe]))
    assert f"pays {min(extra) / 1e3:.1f}-{max(extra) / 1e3:.1f} s more than its median once, at step 7" in text
    assert all(sum(s["triton_builds_per_step"]) == 0 for s in (qe[u], qe[pe], k[u], k[pe]))
    assert _packed_run("qwen35-248k-patched-compiled-h100.json")["documents_per_step"][6] == 1
    assert "1.01x the median" in text and max(q[s]["slowest_after_step_3_x_median"] for s in (u, pc)) < 1.015
    # what dev/first_calls.py logged at that step: the first SDPA call of the plain causal path
    first = _packed_sides("qwen35-248k-first-calls-h100.json")[u]
    log = (DOCS / "bench" / "packed" / "qwen35-248k-first-calls-h100.log").read_text().splitlines()
    step = next(i for i, x in enumerate(log) if "no mask causal" in x)
    assert log[step - 1].split()[-2:] == ["step", "9"]      # 1 optimizer-state step + 2 warm-up precede step 7
    causal_ms = re.search(r"grad: ([0-9.]+) ms", log[step]).group(1)
    assert f"logs there: {causal_ms} ms" in flat
    assert first["step_ms"].index(first["max_step_ms"]) == 6
    assert f"the step took {first['max_step_ms'] - first['median_step_ms']:.0f} ms more than its median" in flat
    # Liger-Kernel: the patched sides against the unpatched ones
    li = _packed_sides("qwen35-248k-unpatched-eager-and-liger-h100.json", "qwen35-248k-patched-liger-h100.json")
    ul, pel, pcl = "unpatched eager + liger", "patched eager + liger", "patched compiled + liger"
    assert f"patched eager steps {speed(li, pel, ul):.2f}x faster than unpatched eager with Liger" in flat
    assert f"peaks at {li[pel]['peak_mb']:,.0f} MB against {li[ul]['peak_mb']:,.0f}" in flat
    assert f"(patched eager without Liger: {qe[pe]['peak_mb']:,.0f})" in flat
    assert (f"(GEMM {li[pel]['gpu_ms_by_family']['gemm']:.1f} against {qe[pe]['gpu_ms_by_family']['gemm']:.1f} "
            "GPU ms)") in flat
    assert f"({qe[pe]['median_step_ms']:.1f} against {li[pel]['median_step_ms']:.1f} ms)" in flat
    assert qe[pe]["median_step_ms"] < li[pel]["median_step_ms"]
    assert f"{li[pcl]['median_step_ms']:.1f} against {q[pc]['median_step_ms']:.1f} ms" in flat
    assert li[pcl]["step_ms"].index(li[pcl]["max_step_ms"]) == 1
    assert f"its second step recompiled ({li[pcl]['max_step_ms'] / 1e3:.1f} s)" in flat
