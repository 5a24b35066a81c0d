"""The charts of `rewy-hf bench --plot` (PNG files, drawn with matplotlib, imported only here and only
when a chart is drawn): the op level's speedups; the model level's step times; the four-sided run's GPU
time by kernel family and loss curves; the packed run's step times and throughput."""

from __future__ import annotations

from .kernel_profile import KERNEL_GROUPS
from .rows import OpRow
from .tables import op_base


def plot_unavailable() -> str | None:
    """Why --plot cannot be honoured (checked before any timing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed; pip install matplotlib (or pip install "
                "'rewy-hf[train]'), or drop --plot")
    return None


def pyplot():
    import matplotlib

    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def save(plt, fig, path: str, **layout) -> None:
    fig.tight_layout(**layout)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_op_speedups(rows: list[OpRow], boundaries: list[str], path: str, title: str) -> None:
    """Grouped bars of speedup (baseline / rewy) per shape, one bar per op, one panel per (boundary, policy)."""
    plt = pyplot()
    policies = list(dict.fromkeys(r.policy for r in rows))
    ops = list(dict.fromkeys(r.op for r in rows))
    shapes = list(dict.fromkeys(r.shape for r in rows))
    panels = [(b, p) for b in boundaries for p in policies]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 1.3 * len(shapes) * max(1, len(ops)) / 2 + 3),
                                                      3.2 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(ops))
    for ax, (b, p) in zip(axes[:, 0], panels):
        for j, op in enumerate(ops):
            by_shape = {r.shape: r.speedup.get(b) for r in rows if r.op == op and r.policy == p}
            xs = [i + (j - (len(ops) - 1) / 2) * width for i in range(len(shapes))]
            heights = [by_shape.get(s) or 0.0 for s in shapes]
            ax.bar(xs, heights, width=width, label=op)
            for x, h in zip(xs, heights):
                if not h:   # no speedup for this shape (a side did not run): say so rather than draw nothing
                    ax.text(x, 0.02, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set_ylim(0, max([1.0] + [r.speedup.get(b) or 0.0 for r in rows if r.policy == p]) * 1.3)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([s.label for s in shapes], fontsize=8)
        ax.set_ylabel("speedup (x)")
        ax.set_title(f"boundary {b} ({'backward only' if b == 'B' else 'forward + backward'}), policy {p}",
                     fontsize=10)
        ax.legend(fontsize=8, ncol=len(ops), loc="upper left")   # the 1.3x headroom keeps it off the bars
    axes[-1, 0].set_xlabel("shape B,T,H (,K,V where not 128)")
    fig.suptitle(title, fontsize=10)
    save(plt, fig, path)


def plot_run(data: dict, path: str) -> list[str]:
    """A run's figure at ``path`` (a live run's data or a --json file's); the paths written."""
    st, kind, device_name = data["settings"], data["kind"], data["device_name"]
    if kind == "ops":
        plot_op_speedups(data["rows"], st["boundaries"], path,
                         f"speedup = {op_base(data)} time / rewy time ({device_name}; >1: rewy faster)")
        return [path]
    if kind == "packed" and not data.get("sides"):
        return []
    title = (f"{st['model']}, {st.get('batch_size', 1)}x{st.get('seq_len')} {'packed ' * (kind == 'packed')}tokens, "
             f"{st.get('dtype')}, {device_name}")
    if kind == "packed":
        plot_packed(data, path, title)
    elif "sides" in data:
        plot_compile_result(data, path, title)
    else:
        plot_model_steps(data, path, title)
    return [path]


def plot_model_steps(res: dict, path: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    values = [res["unpatched"]["median_step_ms"], res["patched"]["median_step_ms"]]
    ax.bar(["unpatched", "patched (rewy)"], values, color=["#888888", "#3a7dc9"])
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{title}\nspeedup {res['speedup']:.3f}x", fontsize=9)
    save(plt, fig, path)


def plot_compile_result(res: dict, path: str, title: str) -> None:
    """GPU time by kernel family per side (stacked bars) and, when run, the four loss curves."""
    from .compile_bench import CURVE_LR

    plt = pyplot()
    curves = any("curve_loss" in r for r in res["sides"].values())
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(10 if curves else 5.5, 3.6))
    ax = axes[0] if curves else axes
    sides = list(res["sides"])
    bottom = [0.0] * len(sides)
    for fam in KERNEL_GROUPS:
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
    save(plt, fig, path)


def plot_packed(data: dict, path: str, title: str) -> None:
    """Left: each side's step time over the run (a stall shows as a spike). Right: tokens/s per side,
    labelled with peak memory."""
    plt = pyplot()
    sides = {k: v for k, v in data["sides"].items() if "skipped" not in v}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for side, r in sides.items():
        left.plot(range(1, len(r["step_ms"]) + 1), r["step_ms"], lw=1, label=side)
    left.set_xlabel("step (a new packing each step)")
    left.set_ylabel("step ms (log scale)")
    left.set_yscale("log")
    left.yaxis.set_major_formatter(lambda y, _: f"{y:g}")
    left.yaxis.set_minor_formatter(lambda y, _: f"{y:g}")
    left.legend(fontsize=7)
    left.set_title(title, fontsize=9)
    names = list(sides)
    bars = right.barh([n.replace(" + ", "\n+ ") for n in names], [sides[n]["tokens_per_s"] for n in names])
    for bar, n in zip(bars, names):
        if sides[n]["peak_mb"] is not None:
            right.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {sides[n]['peak_mb'] / 1024:.1f} GiB",
                       va="center", fontsize=7)
    right.set_xlim(0, 1.2 * max(sides[n]["tokens_per_s"] for n in names))     # room for the memory labels
    right.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")     # 35000 would run into its neighbours
    right.set_xlabel("tokens/s (median step); label: peak memory")
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=7)
    save(plt, fig, path)
