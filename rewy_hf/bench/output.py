"""How `rewy-hf bench` shows its results: progress, the run's environment record, tables,
Markdown and PNG charts (speedups; with --kernel-profile, where each side's time goes)."""

from __future__ import annotations

import contextlib
import math
import platform
import sys
from pathlib import Path

from .. import settings

PLOT_INSTALL_HINT = "pip install matplotlib (or pip install 'rewy-hf[train]')"


# --- progress -----------------------------------------------------------------------------------

class Progress:
    """``step(label)`` after each unit of work, ``write(line)`` for a result line.

    tqdm when installed (the bar on stderr, result lines kept above it), else a
    flushed ``[i/n] label`` line per unit so a long run in a pipe shows it is alive.
    """

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._bar, self._tqdm = None, None
        else:
            self._tqdm = tqdm
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def step(self, label: str, units: int = 1) -> None:
        self.done += units
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(units)
        else:
            print(f"[{self.done}/{self.total}] {self.desc}: {label}", file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)
        sys.stdout.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def progress(total: int, desc: str):
    bar = Progress(total, desc)
    try:
        yield bar
    finally:
        bar.close()


# --- environment --------------------------------------------------------------------------------

def environment(device: str) -> dict:
    import torch

    from ..environment import package_version, rewy_hf_version

    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    return {"device": device, "device_name": name,
            "versions": {"torch": torch.__version__, "triton": package_version("triton"),
                         "flash-linear-attention": package_version("flash-linear-attention"),
                         "fla-core": package_version("fla-core"), "rewy-hf": rewy_hf_version(),
                         "transformers": package_version("transformers"),
                         # FLA dispatches GDN to FlashQLA when it is installed: the baseline then is FlashQLA.
                         "flash-qla": package_version("flash-qla"),
                         "tilelang": package_version("tilelang"), "python": platform.python_version()},
            # a fault or the finite check changes what is timed
            "rewy_env": settings.current()}


# --- op-level tables ----------------------------------------------------------------------------

def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _err(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _mb(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def fastest_round_speedup(row: dict, boundary: str) -> float | None:
    """Baseline time / rewy time, each the fastest of its rounds: the ratio without host stalls,
    which the median of a host-bound side (short kernels, many launches) carries from run to run."""
    b, r = row.get(f"baseline_{boundary}_rounds"), row.get(f"rewy_{boundary}_rounds")
    return min(b) / min(r) if b and r and min(r) > 0 else None


def geomeans(rows: list[dict], boundaries: list[str]) -> list[dict]:
    """Geometric-mean speedup per (op, policy, boundary) over the shapes that have one."""
    out = []
    keys = list(dict.fromkeys((r["op"], r["policy"]) for r in rows))
    for op, policy in keys:
        group = [r for r in rows if r["op"] == op and r["policy"] == policy]
        for b in boundaries:
            speeds = [r.get(f"speedup_{b}") for r in group]
            speeds = [s for s in speeds if s]
            out.append({"op": op, "policy": policy, "boundary": b, "speedup": geomean(speeds), "shapes": len(speeds)})
    return out


def _table(header: list[str], rows: list[list[str]], markdown: bool = False) -> list[str]:
    if markdown:
        md = lambda r: "| " + " | ".join(c or " " for c in r) + " |"  # noqa: E731
        return [md(header), "|" + "---|" * len(header)] + [md(r) for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _shape(r: dict) -> tuple:
    return r["B"], r["T"], r["H"], r["K"], r["V"], r.get("N", 0)


def shape_label(r: dict, kv: bool = False) -> str:
    """B,T,H (with K,V when ``kv``), and the packed sequences of a packed row."""
    return (f"{r['B']},{r['T']},{r['H']}" + (f",{r['K']},{r['V']}" if kv else "")
            + (f",packed={r['N']}" if r.get("N") else ""))


def format_op_table(rows: list[dict], boundaries: list[str], base: str, device: str, markdown: bool = False,
                    report_shapes: list[tuple] | None = None) -> str:
    """One table for one (op, policy): rows are shapes, then the geometric mean.
    ``report_shapes``: every shape of the report; a table missing some says so,
    since its geometric mean is then over fewer shapes than its neighbours'."""
    r0 = rows[0]
    have = {_shape(r) for r in rows}
    missing = [s for s in (report_shapes or []) if s not in have]
    timing_only = any(r.get("baseline_timing_only") for r in rows)
    b = base + ("*" if timing_only else "")
    header = ["B,T,H" + ("" if all(r["K"] == r["V"] == 128 for r in rows) else ",K,V")]
    for bd in boundaries:
        header += [f"{bd}: {b} ms", f"{bd}: rewy ms", f"{bd} speedup"]
    if device == "cuda":
        header += [f"peak MB {b}", "peak MB rewy"]
    header += [f"err {b}", "err rewy"]
    bound = any("bound_ok" in r for r in rows)
    if bound:
        header += [f"bound err {b}", "bound err rewy"]
    strong = any("strong_ok" in r for r in rows)
    if strong:
        header += [f"strong-decay err {b}", "strong-decay err rewy"]
    header += ["check T", "pass"]
    body = []
    for r in rows:
        label = shape_label(r, kv=header[0] != "B,T,H")
        cells = [label]
        for bd in boundaries:
            cells += [_ms(r.get(f"baseline_{bd}_ms")), _ms(r.get(f"rewy_{bd}_ms")), _x(r.get(f"speedup_{bd}"))]
        if device == "cuda":
            cells += [_mb(r.get("baseline_peak_mb")), _mb(r.get("rewy_peak_mb"))]
        err_b = "timing only" if r.get("baseline_timing_only") else _err(r.get("err_baseline"))
        cells += [err_b, _err(r.get("err_rewy"))]
        if bound:
            cells += [_err(r.get("bound_err_baseline")), _err(r.get("bound_err_rewy"))]
        if strong:
            err_sb = "timing only" if r.get("baseline_timing_only") else _err(r.get("strong_err_baseline"))
            cells += [err_sb, _err(r.get("strong_err_rewy"))]
        cells += [str(r["check_T"]) + ("*" if r["check_reduced"] else ""), "PASS" if r.get("ok") else "FAIL"]
        body.append(cells)
    gm = ["geometric mean" + (f" ({len(rows)} of {len(rows) + len(missing)} shapes)" if missing else "")]
    for bd in boundaries:
        gm += ["", "", _x(geomean([r.get(f"speedup_{bd}") for r in rows]))]
    gm += [""] * (len(header) - len(gm))
    body.append(gm)
    several = any(len(r.get(f"rewy_{bd}_rounds") or []) > 1 for r in rows for bd in boundaries)
    if several:
        fast = ["geometric mean, fastest rounds"]
        for bd in boundaries:
            fast += ["", "", _x(geomean([fastest_round_speedup(r, bd) for r in rows]))]
        body.append(fast + [""] * (len(header) - len(fast)))
    backends = sorted({str(r.get("rewy_backend")) for r in rows if r.get("rewy_backend")})
    title = (f"{r0['op']}, rewy policy {r0['policy']} | {base}: {r0.get('baseline_policy') or '-'} | "
             f"rewy backend: {', '.join(backends) or '-'}")
    lines = [f"#### {title}\n" if markdown else title, *_table(header, body, markdown)]
    notes = []
    if missing:
        notes.append("not timed for this op and policy: "
                     + "; ".join(",".join(map(str, s[:3])) + (f",packed={s[5]}" if s[5] else "") for s in missing))
    if timing_only:
        notes.append(f"* {base}: {next(r['baseline_note'] for r in rows if r.get('baseline_timing_only'))}")
    if bound:
        notes.append("bound err: the same check on gates near FLA's safe lower bound (safe_gate=True on both "
                     "sides); pass needs both")
    if strong:
        notes.append("strong-decay err: the same check with a log-gate of about -10 per token; pass needs both")
    if any(r["check_reduced"] for r in rows):
        notes.append("check T*: the gradient check ran at this reduced T (same B, H) to save time and memory")
    if several:
        notes.append("fastest rounds: each side's fastest of its alternating rounds, per shape; the median above "
                     "keeps rounds in which the host stalled either side, this line leaves them out")
    for r in rows:
        for key in ("rewy_error", "baseline_error", "baseline_check_error", "baseline_hint", "bound_rewy_error",
                    "bound_baseline_check_error", "strong_rewy_error", "strong_baseline_check_error"):
            if r.get(key):
                notes.append(f"{shape_label(r)}: {key.replace('_', ' ')}: {r[key]}")
    if markdown:
        return "\n".join(lines + ([""] if notes else []) + [f"- {n}" for n in notes])
    return "\n".join(lines + [f"  {n}" for n in notes])


def format_op_tables(rows: list[dict], boundaries: list[str], base: str, device: str,
                     markdown: bool = False) -> list[str]:
    """One table per (op, policy), in the order the rows first name them, each followed by its peers'
    table where the run timed peers (--peers)."""
    shapes = list(dict.fromkeys(_shape(r) for r in rows))
    out = []
    for key in dict.fromkeys((r["op"], r["policy"]) for r in rows):
        group = [r for r in rows if (r["op"], r["policy"]) == key]
        out.append(format_op_table(group, boundaries, base, device, markdown=markdown, report_shapes=shapes))
        if any(r.get("peers") for r in group):
            out.append(format_peer_table(group, boundaries, base, markdown=markdown))
        out += [format_kernel_table(r, bd, base, device, markdown=markdown) for r in group for bd in boundaries
                if _profiled_sides(r, bd, base)]
    return out


TOP_KERNELS = 10


def _profiled_sides(r: dict, boundary: str, base: str) -> list[tuple[str, dict]]:
    """(side label, its kernels) of one row and boundary, baseline first, then rewy, then the peers."""
    sides = [(base, r.get(f"baseline_kernels_{boundary}")), ("rewy", r.get(f"rewy_kernels_{boundary}"))]
    sides += [(f"peer {n}", p.get(f"kernels_{boundary}")) for n, p in (r.get("peers") or {}).items()]
    return [(label, k) for label, k in sides if k]


def _picked_config(r: dict, kernel: str) -> str:
    """The launch config(s) the row's autotune picks hold for a kernel (by its function name), e.g.
    "BV=64 w4 s1"; "" where the row has no pick of it (a kernel that is not autotuned, or a run made
    before rows recorded their picks)."""
    configs = []
    for qualified, entries in (r.get("autotune_picks") or {}).items():
        if qualified.rsplit(".", 1)[-1] == kernel:
            for e in entries:
                text = " ".join([*(f"{k}={v}" for k, v in e["kwargs"].items()), f"w{e['num_warps']}",
                                 f"s{e['num_stages']}", *([f"maxnreg={e['maxnreg']}"] if e.get("maxnreg") else [])])
                if text not in configs:
                    configs.append(text)
    return "; ".join(configs)


def format_kernel_table(r: dict, boundary: str, base: str, device: str, markdown: bool = False) -> str:
    """Where each side's time goes in one row's profiled ``boundary`` run (--kernel-profile): its
    TOP_KERNELS largest kernels (on CPU: ATen operators, self time) with launches, summed ms and
    share of the side's total; where the row recorded its autotune picks, the config each autotuned
    kernel ran with (warps w, pipeline stages s, and its tile sizes)."""
    from .kernel_profile import largest

    unit = "kernel" if device == "cuda" else "operator"
    body = []
    for label, kernels in _profiled_sides(r, boundary, base):
        total = sum(v["ms"] for v in kernels.values())
        head, (n_rest, ms_rest, launches_rest) = largest(kernels, TOP_KERNELS)
        share = lambda ms: f"{100 * ms / total:.0f} %" if total > 0 else "-"  # noqa: E731
        body += [[label, name, str(n), f"{ms:.3f}", share(ms)] for name, ms, n in head]
        if n_rest:
            body.append([label, f"({n_rest} other {unit}s)", str(launches_rest), f"{ms_rest:.3f}", share(ms_rest)])
        body.append([label, f"all {unit}s", str(sum(v["launches"] for v in kernels.values())), f"{total:.3f}",
                     "100 %" if total > 0 else "-"])
    header = ["side", unit, "launches", "ms", "share"]
    if r.get("autotune_picks"):
        header.append("config")
        body = [[*cells, _picked_config(r, cells[1])] for cells in body]
    what = {"B": "one backward", "FB": "one forward + backward"}.get(boundary, boundary)
    how = "device time" if device == "cuda" else "self CPU time"
    title = f"{r['op']}, rewy policy {r['policy']}, {shape_label(r)}: {unit}s of {what} ({how})"
    lines = [f"##### {title}\n" if markdown else title, *_table(header, body, markdown)]
    notes = [f"{base if side == 'baseline' else side}: not profiled: {why}"
             for side, why in (r.get("kernel_profile_errors") or {}).get(boundary, {}).items()]
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if markdown else [f"  {n}" for n in notes]))


def format_peer_table(rows: list[dict], boundaries: list[str], base: str, markdown: bool = False) -> str:
    """The peers of one (op, policy) beside FLA as installed and rewy: per shape and peer its time, rewy's
    speedup over it, its peak memory, its gradient error and the FLA backends that served it."""
    from .op_bench import PEER_TEXT

    r0 = rows[0]
    names = list(dict.fromkeys(n for r in rows for n in r.get("peers", {})))
    header = ["B,T,H", "peer"] + [c for bd in boundaries for c in (f"{bd}: peer ms", f"{bd}: rewy ms",
                                                                     f"{bd}: rewy speedup")]
    header += ["peak MB peer", "err peer", "served by"]
    body, notes = [], []
    for r in rows:
        for n in names:
            p = r.get("peers", {}).get(n)
            if p is None:
                continue
            cells = [shape_label(r), n]
            if "skipped" in p:
                body.append(cells + ["-"] * (len(header) - 2))
                if p["skipped"] not in notes:
                    notes.append(f"{n}: not timed: {p['skipped']}")
                continue
            for bd in boundaries:
                cells += [_ms(p.get(f"{bd}_ms")), _ms(r.get(f"rewy_{bd}_ms")), _x(p.get(f"speedup_{bd}"))]
            err = "timing only" if p.get("timing_only") else _err(p.get("err"))
            cells += [_mb(p.get("peak_mb")), err, ", ".join(p.get("served_by") or []) or "its own kernels"]
            body.append(cells)
            if p.get("error"):
                notes.append(f"{shape_label(r)} {n}: {p['error']}")
    for n in names:
        timed = [r["peers"][n] for r in rows if n in r.get("peers", {}) and "skipped" not in r["peers"][n]]
        if timed:
            gm = ["geometric mean", n]
            for bd in boundaries:
                gm += ["", "", _x(geomean([p.get(f"speedup_{bd}") for p in timed]))]
            body.append(gm + [""] * (len(header) - len(gm)))
    served = sorted({x for r in rows for x in (r.get("baseline_served_by") or [])})
    title = (f"{r0['op']}, rewy policy {r0['policy']}: peers beside {base} "
             f"({base} as installed was served by: {', '.join(served) or 'its own Triton kernels'})")
    notes += [f"{n}: {PEER_TEXT.get(n, n)}" for n in names]
    lines = [f"#### {title}\n" if markdown else title, *_table(header, body, markdown)]
    if markdown:
        return "\n".join(lines + [""] + [f"- {x}" for x in notes])
    return "\n".join(lines + [f"  {x}" for x in notes])


def markdown_report(data: dict, base: str) -> str:
    """A whole run (a live run's data or a --json file) as Markdown, for docs/performance.md."""
    v = data.get("versions", {})
    st = data.get("settings", {})
    head = [f"Device: {data.get('device_name')}; " + ", ".join(f"{k} {x}" for k, x in v.items() if x) + ".", ""]
    if data.get("error"):
        return "\n".join(head + [f"This run could not run: {data['error']}"]) + "\n"
    if data.get("kind") == "model" and "sides" in data:
        from .compile_bench import format_compile_result

        body = format_compile_result(data, st.get("model", "?"), markdown=True)
    elif data.get("kind") == "model":
        body = format_model_result(data, st.get("model", "?"), st, markdown=True)
    else:
        head += [f"Timing: {st.get('timing')}.", ""]
        if st.get("autotune"):
            head += [f"Autotune: {st['autotune']}.", ""]
        head += [f"Check: {st.get('check')}.", ""]
        rows = data.get("rows", [])
        body = "\n\n".join(format_op_tables(rows, st.get("boundaries", []), base, data.get("device", "cuda"),
                                             markdown=True))
    tail = [] if data.get("complete", False) else ["", "(This run did not finish: these are the rows it wrote.)"]
    return "\n".join(head + [body] + tail) + "\n"


def format_row_line(r: dict, boundaries: list[str], base: str) -> str:
    """The one line printed as each configuration finishes."""
    parts = [f"[{r['op']} {r['policy']}] {shape_label(r, kv=True)}"]
    for bd in boundaries:
        parts.append(f"{bd} {base} {_ms(r.get(f'baseline_{bd}_ms'))} / rewy {_ms(r.get(f'rewy_{bd}_ms'))} ms "
                     f"({_x(r.get(f'speedup_{bd}'))})")
    err_b = "timing only" if r.get("baseline_timing_only") else _err(r.get("err_baseline"))
    errs = f"err {base} {err_b} rewy {_err(r.get('err_rewy'))}"
    if "bound_ok" in r:
        errs += f"; bound err {base} {_err(r.get('bound_err_baseline'))} rewy {_err(r.get('bound_err_rewy'))}"
    parts.append(f"{errs} -> {'PASS' if r.get('ok') else 'FAIL'}")
    for name, p in (r.get("peers") or {}).items():
        if "skipped" in p:
            continue
        times = ", ".join(f"{bd} {_ms(p.get(f'{bd}_ms'))} ms ({_x(p.get(f'speedup_{bd}'))})" for bd in boundaries)
        parts.append(f"{name} {times}, err {'timing only' if p.get('timing_only') else _err(p.get('err'))}")
    return "; ".join(parts)


# --- model-level --------------------------------------------------------------------------------

def format_model_result(res: dict, spec: str, settings: dict, markdown: bool = False) -> str:
    u, p = res["unpatched"], res["patched"]
    lines = [f"rewy-hf bench --model {spec}: one training step (forward + loss backward + AdamW step + zero_grad), "
             f"batch {settings['batch_size']} x {settings['seq_len']} tokens, {settings['dtype']}, "
             f"{settings['device']}, median of {settings['steps']} step(s) after {settings['warmup']} warm-up",
             ""]
    header = ["side", "median step ms", "tokens/s", "peak MB", "loss (1st step)"]
    rows = [[name, _ms(d["median_step_ms"]), f"{d['tokens_per_s']:.0f}", _mb(d["peak_mb"]), f"{d['loss'][0]:.5f}"]
            for name, d in (("unpatched", u), ("patched (rewy)", p))]
    lines += _table(header, rows, markdown)
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


# --- plots --------------------------------------------------------------------------------------

def plot_unavailable() -> str | None:
    """Why --plot cannot be honoured (checked before any timing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--plot needs matplotlib, which is not installed; {PLOT_INSTALL_HINT}, or drop --plot"
    return None


def pyplot():
    import matplotlib

    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_op_speedups(rows: list[dict], boundaries: list[str], path: str, title: str) -> None:
    """Grouped bars of speedup (baseline / rewy) per shape, one bar per op, one panel per (boundary, policy)."""
    plt = pyplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    shapes = list(dict.fromkeys(_shape(r) for r in rows))
    panels = [(b, p) for b in boundaries for p in policies]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 1.3 * len(shapes) * max(1, len(ops)) / 2 + 3),
                                                      3.2 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(ops))
    for ax, (b, p) in zip(axes[:, 0], panels):
        for j, op in enumerate(ops):
            by_shape = {_shape(r): r.get(f"speedup_{b}")
                        for r in rows if r["op"] == op and r["policy"] == p}
            xs = [i + (j - (len(ops) - 1) / 2) * width for i in range(len(shapes))]
            heights = [by_shape.get(s) or 0.0 for s in shapes]
            ax.bar(xs, heights, width=width, label=op)
            for x, h in zip(xs, heights):
                if not h:   # no speedup for this shape (a side did not run): say so rather than draw nothing
                    ax.text(x, 0.02, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set_ylim(0, max([1.0] + [r.get(f"speedup_{b}") or 0.0 for r in rows if r["policy"] == p]) * 1.3)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{s[0]},{s[1]},{s[2]}" + ("" if s[3] == s[4] == 128 else f",{s[3]},{s[4]}")
                            + (f",packed={s[5]}" if s[5] else "") for s in shapes], fontsize=8)
        ax.set_ylabel("speedup (x)")
        ax.set_title(f"boundary {b} ({'backward only' if b == 'B' else 'forward + backward'}), policy {p}",
                     fontsize=10)
        ax.legend(fontsize=8, ncol=len(ops), loc="upper left")   # the 1.3x headroom keeps it off the bars
    axes[-1, 0].set_xlabel("shape B,T,H (,K,V where not 128)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# A figure of more panels than this would be too tall to read; the tables carry every profile.
MAX_KERNEL_PANELS = 16


def kernel_plot_path(path: str) -> str:
    """Where the kernel-profile figure of a run plotted to ``path`` goes: beside it, ``-kernels`` added."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-kernels{p.suffix or '.png'}"))


def plot_op_run(rows: list[dict], boundaries: list[str], path: str, base: str, device_name: str,
                device: str) -> list[str]:
    """The speedup figure at ``path`` and, where the run profiled its kernels (--kernel-profile), the
    kernel figure beside it (``kernel_plot_path``); returns the paths written."""
    plot_op_speedups(rows, boundaries, path, f"speedup = {base} time / rewy time ({device_name}; >1: rewy faster)")
    panels = [(r, bd) for r in rows for bd in boundaries if _profiled_sides(r, bd, base)]
    if not panels:
        return [path]
    title = f"where the time goes ({device_name})"
    if len(panels) > MAX_KERNEL_PANELS:
        title += f"; the first {MAX_KERNEL_PANELS} of {len(panels)} profiled runs (the tables list all)"
    plot_kernel_profiles(panels[:MAX_KERNEL_PANELS], kernel_plot_path(path), base, device, title)
    return [path, kernel_plot_path(path)]


def plot_kernel_profiles(panels: list[tuple[dict, str]], path: str, base: str, device: str, title: str) -> None:
    """One panel per profiled (row, boundary): a horizontal bar per side, stacked by its largest kernels
    (one colour per kernel name across all panels, the rest grey), so the sides' stages line up."""
    from .kernel_profile import largest

    plt = pyplot()
    top = 6
    panel_sides = [_profiled_sides(r, bd, base) for r, bd in panels]
    names: list[str] = []
    for sides in panel_sides:
        for _, kernels in sides:
            names += [n for n, _, _ in largest(kernels, top)[0] if n not in names]
    cmap = plt.get_cmap("tab20")
    colour = {n: cmap(i % 20) for i, n in enumerate(names)}
    # The legend takes a fixed height in inches, whatever the number of panels: as a fraction of a tall
    # figure it would leave a gap above itself, and the title would sit over the first panel.
    legend_in = 0.25 + 0.17 * ((len(names) + 1) // 2)
    height = legend_in + 0.6 + 0.5 * len(panels) + 0.45 * sum(len(sides) for sides in panel_sides)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, height), squeeze=False)
    for ax, (r, bd), sides in zip(axes[:, 0], panels, panel_sides):
        for y, (label, kernels) in enumerate(sides):
            left = 0.0
            head, (_, ms_rest, _) = largest(kernels, top)
            for name, ms, _ in head:
                ax.barh(y, ms, left=left, color=colour[name], edgecolor="white", linewidth=0.5)
                left += ms
            ax.barh(y, ms_rest, left=left, color="#bbbbbb", edgecolor="white", linewidth=0.5)
            ax.text(left + ms_rest, y, f" {left + ms_rest:.3f} ms", va="center", fontsize=8)
        ax.set_yticks(range(len(sides)))
        ax.set_yticklabels([label for label, _ in sides], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(sum(v["ms"] for v in k.values()) for _, k in sides) * 1.25)
        what = "backward" if bd == "B" else "forward + backward"
        ax.set_title(f"{r['op']} {r['policy']}, {shape_label(r)}: {what}", fontsize=9)
    unit = "kernel" if device == "cuda" else "operator"
    axes[-1, 0].set_xlabel(f"ms per {unit}, summed over launches (grey: the other {unit}s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in names]
    fig.legend(handles, [n[:60] for n in names], fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.suptitle(title, fontsize=10, y=1 - 0.12 / height, va="top")
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))    # tight_layout makes room for the suptitle itself
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_model_steps(res: dict, path: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    values = [res["unpatched"]["median_step_ms"], res["patched"]["median_step_ms"]]
    ax.bar(["unpatched", "patched (rewy)"], values, color=["#888888", "#3a7dc9"])
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{title}\nspeedup {res['speedup']:.3f}x", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compile_result(res: dict, path: str, title: str) -> None:
    """GPU time by kernel family per side (stacked bars) and, when run, the four loss curves."""
    from .compile_bench import CURVE_LR, FAMILIES

    plt = pyplot()
    curves = any("curve_loss" in r for r in res["sides"].values())
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(10 if curves else 5.5, 3.6))
    ax = axes[0] if curves else axes
    sides = list(res["sides"])
    bottom = [0.0] * len(sides)
    for fam in FAMILIES:
        vals = [(res["sides"][sd].get("gpu_ms_by_family") or {}).get(fam, 0.0) for sd in sides]
        ax.bar([sd.replace(" ", "\n") for sd in sides], vals, bottom=bottom, label=fam)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for j, sd in enumerate(sides):
        ax.text(j, bottom[j], f"{res['sides'][sd]['median_step_ms']:.0f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GPU ms per step (profiled step)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    if curves:
        for sd in sides:
            if "curve_loss" in res["sides"][sd]:
                axes[1].plot(res["sides"][sd]["curve_loss"], label=sd, lw=1)
        axes[1].set_xlabel("training step")
        axes[1].set_ylabel("loss (log scale)")
        axes[1].set_yscale("log")
        axes[1].legend(fontsize=7)
        on = "the timing batch" if "timing batch" in res.get("curve", {}).get("batches", "") else "corpus batches"
        axes[1].set_title(f"loss on {on}, AdamW lr {CURVE_LR:g}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
