"""The tables of `rewy-hf bench`, as plain text and as Markdown (for docs/performance.md): the op
level's per (op, policy), the model level's, and the four-sided and packed runs' sides."""

from __future__ import annotations

import math

from .kernel_profile import KERNEL_GROUPS
from .op_bench import baseline_label
from .rows import Check, OpRow


def cell(x, fmt: str, suffix: str = "") -> str:
    """A table cell: ``x`` formatted, or "-" where there is none."""
    return "-" if x is None else format(x, fmt) + suffix


def ms_cell(x) -> str:
    return cell(x, ".3f" if x is None or x < 10 else ".1f")


def speedup_cell(x) -> str:
    return cell(x, ".2f", "x")


def table(header: list[str], rows: list[list[str]], markdown: bool = False, rule: bool = True) -> list[str]:
    """Markdown, or plain columns (the first left-aligned, the rest right-aligned) with a rule under
    the header unless ``rule`` is False."""
    if markdown:
        md = lambda r: "| " + " | ".join(c or " " for c in r) + " |"  # noqa: E731
        return [md(header), "|" + "---|" * len(header)] + [md(r) for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header), *(["  ".join("-" * w for w in widths)] if rule else []), *map(line, rows)]


def titled(title: str, lines: list[str], notes: list[str], markdown: bool, level: str = "####") -> str:
    """A table under its title, its notes below it (Markdown: a list after a blank line)."""
    head = [f"{level} {title}\n" if markdown else title, *lines]
    if markdown:
        return "\n".join(head + ([""] if notes else []) + [f"- {n}" for n in notes])
    return "\n".join(head + [f"  {n}" for n in notes])


# --- op level -----------------------------------------------------------------------------------

def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def fastest_round_speedup(row: OpRow, boundary: str) -> float | None:
    """Baseline time / rewy time, each the fastest of its rounds: the ratio without host stalls,
    which the median of a host-bound side (short kernels, many launches) carries from run to run."""
    b, r = row.baseline.rounds.get(boundary), row.rewy.rounds.get(boundary)
    return min(b) / min(r) if b and r and min(r) > 0 else None


def _groups(rows: list[OpRow]) -> dict[tuple[str, str], list[OpRow]]:
    """The rows per (op, policy), in the order the rows first name them."""
    out: dict[tuple[str, str], list[OpRow]] = {}
    for r in rows:
        out.setdefault((r.op, r.policy), []).append(r)
    return out


def geomeans(rows: list[OpRow], boundaries: list[str]) -> list[dict]:
    """Geometric-mean speedup per (op, policy, boundary) over the shapes that have one."""
    out = []
    for (op, policy), group in _groups(rows).items():
        for b in boundaries:
            speeds = [s for r in group if (s := r.speedup.get(b))]
            out.append({"op": op, "policy": policy, "boundary": b, "speedup": geomean(speeds), "shapes": len(speeds)})
    return out


def _label(s, kv: bool = False) -> str:
    return f"{s.B},{s.T},{s.H}" + (f",{s.K},{s.V}" if kv else "") + (f",packed={s.N}" if s.N else "")


def shape_label(r: OpRow, kv: bool = False) -> str:
    """B,T,H (with K,V when ``kv``), and the packed sequences of a packed row."""
    return _label(r.shape, kv)


def _errors(r: OpRow) -> list[tuple[str, str]]:
    """What went wrong in a row, each as (what, the error)."""
    c = r.check or Check()
    found = [("rewy error", r.rewy.error), ("baseline error", r.baseline.error),
             ("baseline check error", c.baseline_check_error), ("baseline hint", r.baseline_hint)]
    for name in ("bound", "strong"):
        second = getattr(r, name) or Check()
        found += [(f"{name} rewy error", second.rewy_error),
                  (f"{name} baseline check error", second.baseline_check_error)]
    return [(what, why) for what, why in found if why]


def _err_of(check: Check | None, side: str, timing_only: bool = False) -> str:
    return "timing only" if timing_only else cell(getattr(check, f"err_{side}", None), ".1e")


# The second checks' columns and notes: (column name, OpRow field, marked timing only as the main check, note).
_SECOND_CHECKS = (("bound err", "bound", False, "bound err: the same check on gates near FLA's safe lower bound "
                   "(safe_gate=True on both sides); pass needs both"),
                  ("strong-decay err", "strong", True, "strong-decay err: the same check with a log-gate of about "
                   "-10 per token; pass needs both"))


def format_op_table(rows: list[OpRow], boundaries: list[str], base: str, device: str, markdown: bool = False,
                    report_shapes: list | None = None) -> str:
    """One table for one (op, policy): rows are shapes, then the geometric mean. ``report_shapes``: every
    shape of the report; a table missing some says so, as its mean is then over fewer shapes."""
    r0, cuda = rows[0], device == "cuda"
    missing = [s for s in (report_shapes or []) if s not in {r.shape for r in rows}]
    timing_only = any(r.baseline_timing_only for r in rows)
    b = base + ("*" if timing_only else "")
    kv = not all(r.shape.K == r.shape.V == 128 for r in rows)
    checks = [("err", "check", True, None)] + [c for c in _SECOND_CHECKS if any(getattr(r, c[1]) for r in rows)]
    header = ["B,T,H" + (",K,V" if kv else "")]
    header += [h for bd in boundaries for h in (f"{bd}: {b} ms", f"{bd}: rewy ms", f"{bd} speedup")]
    header += [h for name in ["peak MB"] * cuda + [c[0] for c in checks] for h in (f"{name} {b}", f"{name} rewy")]
    header += ["check T", "pass"]
    body = []
    for r in rows:
        cells = [shape_label(r, kv=kv)]
        for bd in boundaries:
            cells += [ms_cell(r.baseline.ms.get(bd)), ms_cell(r.rewy.ms.get(bd)), speedup_cell(r.speedup.get(bd))]
        cells += [cell(r.baseline.peak_mb, ".0f"), cell(r.rewy.peak_mb, ".0f")] if cuda else []
        for _, field, marked, _ in checks:
            c = getattr(r, field)
            cells += [_err_of(c, "baseline", marked and r.baseline_timing_only), _err_of(c, "rewy")]
        body.append(cells + [str(r.check_T) + ("*" if r.check_reduced else ""), "PASS" if r.ok else "FAIL"])
    several = any(len(r.rewy.rounds.get(bd) or []) > 1 for r in rows for bd in boundaries)
    means = [("geometric mean" + (f" ({len(rows)} of {len(rows) + len(missing)} shapes)" if missing else ""),
              lambda r, bd: r.speedup.get(bd))]
    means += [("geometric mean, fastest rounds", fastest_round_speedup)] if several else []
    for label, speedup in means:
        gm = [label] + [c for bd in boundaries for c in ("", "", speedup_cell(geomean([speedup(r, bd) for r in rows])))]
        body.append(gm + [""] * (len(header) - len(gm)))
    backends = sorted({str(r.check.rewy_backend) for r in rows if r.check and r.check.rewy_backend})
    title = (f"{r0.op}, rewy policy {r0.policy} | {base}: {r0.baseline_policy or '-'} | "
             f"rewy backend: {', '.join(backends) or '-'}")
    notes = ["not timed for this op and policy: " + "; ".join(_label(s) for s in missing)] if missing else []
    if timing_only:
        notes.append(f"* {base}: {next(r.baseline_note for r in rows if r.baseline_timing_only)}")
    notes += [note for *_, note in checks if note]
    if any(r.check_reduced for r in rows):
        notes.append("check T*: the gradient check ran at this reduced T (same B, H) to save time and memory")
    if several:
        notes.append("fastest rounds: each side's fastest of its alternating rounds, per shape; the median above "
                     "keeps rounds in which the host stalled either side, this line leaves them out")
    notes += [f"{shape_label(r)}: {what}: {why}" for r in rows for what, why in _errors(r)]
    return titled(title, table(header, body, markdown), notes, markdown)


def format_op_tables(rows: list[OpRow], boundaries: list[str], base: str, device: str,
                     markdown: bool = False, more=None) -> list[str]:
    """One table per (op, policy), in the order the rows first name them, each followed by what
    ``more`` (an ``op_bench.Extra``'s ``tables``) makes of its rows."""
    shapes = list(dict.fromkeys(r.shape for r in rows))
    out = []
    for group in _groups(rows).values():
        out.append(format_op_table(group, boundaries, base, device, markdown=markdown, report_shapes=shapes))
        out += more(group, boundaries, base, device, markdown) if more else []
    return out


def format_row_line(r: OpRow, boundaries: list[str], base: str) -> str:
    """The one line printed as each configuration finishes."""
    parts = [f"[{r.op} {r.policy}] {shape_label(r, kv=True)}"]
    for bd in boundaries:
        parts.append(f"{bd} {base} {ms_cell(r.baseline.ms.get(bd))} / rewy {ms_cell(r.rewy.ms.get(bd))} ms "
                     f"({speedup_cell(r.speedup.get(bd))})")
    errs = f"err {base} {_err_of(r.check, 'baseline', r.baseline_timing_only)} rewy {_err_of(r.check, 'rewy')}"
    if r.bound:
        errs += f"; bound err {base} {cell(r.bound.err_baseline, '.1e')} rewy {cell(r.bound.err_rewy, '.1e')}"
    parts.append(f"{errs} -> {'PASS' if r.ok else 'FAIL'}")
    return "; ".join(parts)


# --- model level --------------------------------------------------------------------------------

def format_model_result(res: dict, spec: str, settings: dict, markdown: bool = False) -> str:
    u, p = res["unpatched"], res["patched"]
    lines = [f"rewy-hf bench --model {spec}: one training step (forward + loss backward + AdamW step + zero_grad), "
             f"batch {settings['batch_size']} x {settings['seq_len']} tokens, {settings['dtype']}, "
             f"{settings['device']}, median of {settings['steps']} step(s) after {settings['warmup']} warm-up",
             ""]
    header = ["side", "median step ms", "tokens/s", "peak MB", "loss (1st step)"]
    rows = [[name, ms_cell(d["median_step_ms"]), f"{d['tokens_per_s']:.0f}", cell(d["peak_mb"], ".0f"),
             f"{d['loss'][0]:.5f}"] for name, d in (("unpatched", u), ("patched (rewy)", p))]
    lines += table(header, rows, markdown)
    lines.append(f"\nspeedup (unpatched / patched step time): {res['speedup']:.3f}x")
    lines.append(f"patched layers: {res['patched_layers']}; optimized backward calls in the timed steps: "
                 f"{res['optimized_backward_calls']}; fallbacks: {res['fallback_calls']}")
    if (settings.get("gdn_guard") or {}).get("was_active"):
        lines.append("note: the unpatched side ran FLA's GDN backward with its guard lifted (Hopper, triton < 3.7.1, "
                     "FLA #640): its step time is valid, its gradients (and so its later losses) are not trusted")
    if res.get("reference_cores_unpatched"):
        lines.append("note: on CPU the unpatched side runs the reference cores (transformers' torch function, or "
                     "rewy's float64 recurrence for FLA layers), not FLA; CPU step times say nothing about a GPU")
    return "\n".join(lines)


def _families(r: dict) -> list[str]:
    per = r.get("gpu_ms_by_family") or {}
    return [f"{per[f]:.1f}" if f in per else "-" for f in KERNEL_GROUPS]


def format_side(side: str, r: dict) -> str:
    """One side's line of a four-sided run, as it finishes."""
    per = r.get("gpu_ms_by_family") or {}
    fams = ", ".join(f"{f} {per[f]:.1f}" for f in KERNEL_GROUPS) if per else ""
    comp = f", compile {r['compile_s']:.1f} s, {r.get('graph_breaks')} graph breaks, {r.get('graphs')} graphs" \
        if r["compile_s"] is not None else ""
    peak = f", peak {r['peak_mb']:.0f} MB" if r["peak_mb"] is not None else ""
    return (f"{side}: {r['median_step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s{peak}{comp}"
            + (f"; GPU ms by family: {fams}" if fams else ""))


def format_compile_result(res: dict, spec: str, markdown: bool = False) -> str:
    """The four sides as a table (plain text, or Markdown for docs/performance.md), then the curve and
    the recompiles at further lengths when they were run."""
    from .compile_bench import CURVE_LR, SIDES, curve_max_rel_diff

    head = ["side", "step ms", "tokens/s", "x unpatched eager", "peak MB", "compile s", "graph breaks",
            "graphs", *(f"{f} ms" for f in KERNEL_GROUPS)]
    rows = []
    # A run stopped part way (its JSON written side by side) has no summary fields: derive them.
    base = res["sides"].get("unpatched eager")
    for side, r in res["sides"].items():
        x = r.get("speedup_vs_unpatched_eager") or (base["median_step_ms"] / r["median_step_ms"] if base else None)
        rows.append([side, f"{r['median_step_ms']:.1f}", f"{r['tokens_per_s']:.0f}", cell(x, ".3f"),
                     cell(r.get("peak_mb"), ".0f"), cell(r.get("compile_s"), ".1f"),
                     str(r.get("graph_breaks", "-")), str(r.get("graphs", "-")), *_families(r)])
    st = res.get("settings", {})
    if markdown:
        lines = table(head, rows, markdown=True)
    else:
        tokens = res.get("tokens_per_step") or st.get("batch_size", 0) * st.get("seq_len", 0) or "?"
        lines = [f"{spec}: {tokens} tokens per step", *table(head, rows, rule=False)]
    lines.append("")
    asked = st.get("sides", SIDES)
    if stopped := [side for side in SIDES if side in asked and side not in res["sides"]]:
        lines.append(f"not measured (the run stopped before): {', '.join(stopped)}")
    if left_out := [side for side in SIDES if side not in asked]:
        lines.append(f"not asked for (--sides): {', '.join(left_out)}")
    if res.get("sources"):
        lines.append("sides from separate runs on the same settings and weights: "
                     + "; ".join(f"{src}: {', '.join(names)}" for src, names in res["sources"].items()))
    lines += [f"{side}: its delta-rule calls ran {r['core_under_compile']}" for side, r in res["sides"].items()
              if "core_under_compile" in r]
    if "speedup_vs_unpatched_compiled" in res:
        lines.append(f"patched compiled vs unpatched compiled: {res['speedup_vs_unpatched_compiled']:.3f}x")
    curves = {side: r["curve_loss"] for side, r in res["sides"].items() if "curve_loss" in r}
    if base is not None and "unpatched eager" in curves and len(curves) > 1:
        ref = curves["unpatched eager"]
        diffs = ", ".join(f"{side} {curve_max_rel_diff(c, ref):.2e}"
                          for side, c in curves.items() if side != "unpatched eager")
        batches = "the timing batch" if "timing batch" in res.get("curve", {}).get("batches", "") else "corpus batches"
        lines.append(f"loss over {len(ref)} training steps on {batches} (AdamW lr {CURVE_LR:g}, from "
                     f"{ref[0]:.3f} to {ref[-1]:.3f} unpatched eager): largest relative difference from unpatched "
                     f"eager at any step: {diffs}")
    lines += [f"{side}: graphs compiled by one step at each further length: "
              + ", ".join(f"T={t}: {n}" for t, n in r["graphs_compiled_at_length"].items())
              for side, r in res["sides"].items() if "graphs_compiled_at_length" in r]
    return "\n".join(lines)


def format_packed_result(data: dict, markdown: bool = False) -> str:
    """One line per side: median / p90 / max step, the stall figure, tokens/s, x the fastest
    unpatched side, peak memory, graphs and breaks, GPU ms by family; then the documents check."""
    from .packed_bench import packed_summary

    summary = packed_summary(data)
    vs = summary.get("vs_fastest_unpatched", {})
    head = ["side", "median ms", "p90 ms", "max ms", "slowest after 3 / median", "tokens/s",
            f"x {summary.get('fastest_unpatched', 'fastest unpatched')}", "peak MB", "graphs", "breaks",
            *(f"{f} ms" for f in KERNEL_GROUPS)]
    rows = []
    sides = data.get("sides", {})
    for side, r in sides.items():
        if "skipped" in r:
            rows.append([side, *["-"] * (len(head) - 1)])
            continue
        label = side if "stopped_after_steps" not in r else \
            f"{side} (stopped after {r['stopped_after_steps']} of {data.get('settings', {}).get('steps', '?')} steps)"
        rows.append([label, f"{r['median_step_ms']:.1f}", f"{r['p90_step_ms']:.1f}", f"{r['max_step_ms']:.1f}",
                     cell(r.get("slowest_after_step_3_x_median"), ".2f"), f"{r['tokens_per_s']:.0f}",
                     f"{vs[side]['speedup']:.2f}" if side in vs else "-", cell(r["peak_mb"], ".0f"),
                     str(r.get("graphs", "-")), str(r.get("graph_breaks", "-")), *_families(r)])
    lines = table(head, rows, markdown, rule=False)
    if check := data.get("documents_check"):
        lines += ["", f"documents check ({check['dtype']}, against {check['reference']}; lengths {check['lengths']}):"]
        for side in ("patched", "unpatched"):
            c = check[side]
            lines.append(f"  {side}: packed row logits {c['packed']['logits_rel_err']:.3g}, gradients "
                         f"{c['packed']['grads_rel_err']:.3g}; documents alone logits {c['alone']['logits_rel_err']:.3g}, "
                         f"gradients {c['alone']['grads_rel_err']:.3g}")
    return "\n".join(lines + [f"{side}: {r['skipped']}" for side, r in sides.items() if "skipped" in r])


def op_base(data: dict) -> str:
    return baseline_label(data.get("device", "cuda"), data.get("versions"))

