"""``--kernel-profile``: where each side's time goes in one more run after its timing rounds, per
configuration and boundary: its kernels' device time and launches on CUDA (per ATen operator, self
time, on CPU), as tables beside the other sides' and a figure beside the --plot; and, on CUDA, the
autotune picks each row ran with (``autotune_picks`` in its JSON, which dev/kernel_registers.py
--picks compiles again)."""

from __future__ import annotations

from pathlib import Path

from rewy_hf.bench.autotune_picks import BENCH_MODULES, autotuners
from rewy_hf.bench.kernel_profile import kernel_times
from rewy_hf.bench.plots import pyplot, save
from rewy_hf.bench.rows import OpRow
from rewy_hf.bench.tables import op_base, shape_label, table, titled
from rewy_hf.bench.timing import describe, runner

from .peers import Peer, peers_of

TOP_KERNELS = 10


def profile_row(row: OpRow, sides: dict, peers: dict[str, Peer], boundaries: list[str], inputs, do,
                device: str) -> None:
    """Each timed side's kernels over one more run per boundary (warm after its timing rounds) into
    the row (a peer's into its ``Peer``); a side that cannot be profiled keeps its timing, and the row
    says why."""
    for name, (impl, timing) in sides.items():
        for bd in boundaries:
            if not timing.ms.get(bd):
                continue
            try:
                kernels = kernel_times(runner(bd, impl.fn, inputs, do, impl.scope), device)
            except Exception as exc:
                errors = row.more.setdefault("kernel_profile_errors", {})
                errors.setdefault(bd, {})[name] = describe(exc)
                continue
            if name.startswith("peer:"):
                peers[name.removeprefix("peer:")].kernels[bd] = kernels
            else:
                row.more[f"{name}_kernels_{bd}"] = kernels


def largest(times: dict[str, dict], top: int) -> tuple[list[tuple[str, float, int]], tuple[int, float, int]]:
    """The ``top`` entries by time as (name, ms, launches), and the rest as (entries, ms, launches)."""
    ranked = sorted(times.items(), key=lambda kv: -kv[1]["ms"])
    head = [(name, v["ms"], v["launches"]) for name, v in ranked[:top]]
    rest = [v for _, v in ranked[top:]]
    return head, (len(rest), sum(v["ms"] for v in rest), sum(v["launches"] for v in rest))


def _plain(value):
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def picks(prefixes: tuple[str, ...] = BENCH_MODULES) -> dict[str, list[dict]]:
    """What every autotuner under ``prefixes`` has chosen so far: ``module.kernel`` -> one entry per tuned
    key, each with the key's values (named by the autotuner's key list, then the dtypes of the tensor
    arguments, as Triton builds the key) and the chosen config. Autotuners that chose nothing (none
    launched, or a single config, which Triton runs without timing) are left out."""
    out: dict[str, list[dict]] = {}
    for tuner in autotuners(prefixes):
        if not tuner.cache:
            continue
        fn = tuner.base_fn
        entries = []
        for key, config in tuner.cache.items():
            key = list(key) if isinstance(key, tuple) else [key]
            entries.append({"key_names": list(tuner.keys), "key": [_plain(v) for v in key],
                            "kwargs": {k: _plain(v) for k, v in config.kwargs.items()},
                            "num_warps": config.num_warps, "num_stages": config.num_stages,
                            **({"maxnreg": config.maxnreg} if getattr(config, "maxnreg", None) else {})})
        out[f"{fn.__module__}.{fn.__name__}"] = entries
    return dict(sorted(out.items()))


def profiled_sides(r: OpRow, boundary: str, base: str) -> list[tuple[str, dict]]:
    """(side label, its kernels) of one row and boundary, baseline first, then rewy, then the peers."""
    sides = [(base, r.more.get(f"baseline_kernels_{boundary}")), ("rewy", r.more.get(f"rewy_kernels_{boundary}"))]
    sides += [(f"peer {n}", p.kernels.get(boundary)) for n, p in peers_of(r).items()]
    return [(label, k) for label, k in sides if k]


def picked_config(r: OpRow, kernel: str) -> str:
    """The launch config(s) the row's autotune picks hold for a kernel (by its function name), e.g.
    "BV=64 w4 s1"; "" where the row has no pick of it (a kernel that is not autotuned, or a run made
    before rows recorded their picks)."""
    configs = []
    for qualified, entries in (r.more.get("autotune_picks") or {}).items():
        if qualified.rsplit(".", 1)[-1] == kernel:
            for e in entries:
                text = " ".join([*(f"{k}={v}" for k, v in e["kwargs"].items()), f"w{e['num_warps']}",
                                 f"s{e['num_stages']}", *([f"maxnreg={e['maxnreg']}"] if e.get("maxnreg") else [])])
                if text not in configs:
                    configs.append(text)
    return "; ".join(configs)


def format_kernel_table(r: OpRow, boundary: str, base: str, device: str, markdown: bool = False) -> str:
    """Where each side's time goes in one row's profiled ``boundary`` run: its
    TOP_KERNELS largest kernels (on CPU: ATen operators, self time) with launches, summed ms and
    share of the side's total; where the row recorded its autotune picks, the config each autotuned
    kernel ran with (warps w, pipeline stages s, and its tile sizes)."""
    unit = "kernel" if device == "cuda" else "operator"
    body = []
    for label, kernels in profiled_sides(r, boundary, base):
        total = sum(v["ms"] for v in kernels.values())
        head, (n_rest, ms_rest, launches_rest) = largest(kernels, TOP_KERNELS)
        share = lambda ms: f"{100 * ms / total:.0f} %" if total > 0 else "-"  # noqa: E731
        body += [[label, name, str(n), f"{ms:.3f}", share(ms)] for name, ms, n in head]
        if n_rest:
            body.append([label, f"({n_rest} other {unit}s)", str(launches_rest), f"{ms_rest:.3f}", share(ms_rest)])
        body.append([label, f"all {unit}s", str(sum(v["launches"] for v in kernels.values())), f"{total:.3f}",
                     "100 %" if total > 0 else "-"])
    header = ["side", unit, "launches", "ms", "share"]
    if r.more.get("autotune_picks"):
        header.append("config")
        body = [[*cells, picked_config(r, cells[1])] for cells in body]
    what = {"B": "one backward", "FB": "one forward + backward"}.get(boundary, boundary)
    how = "device time" if device == "cuda" else "self CPU time"
    title = f"{r.op}, rewy policy {r.policy}, {shape_label(r)}: {unit}s of {what} ({how})"
    notes = [f"{base if side == 'baseline' else side}: not profiled: {why}"
             for side, why in (r.more.get("kernel_profile_errors") or {}).get(boundary, {}).items()]
    text = titled(title, table(header, body, markdown), notes, markdown, level="#####")
    return text + ("\n" if markdown and not notes else "")     # in Markdown a blank line follows, notes or not


# A figure of more panels than this would be too tall to read; the tables carry every profile.
MAX_KERNEL_PANELS = 16


def kernel_plot_path(path: str) -> str:
    """Where the kernel-profile figure of a run plotted to ``path`` goes: beside it, ``-kernels`` added."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-kernels{p.suffix or '.png'}"))


def plot_kernels(data: dict, path: str) -> list[str]:
    """Where an op-level run profiled its kernels, the kernel figure beside its --plot at ``path``
    (``kernel_plot_path``); the paths written."""
    base, rows, boundaries = op_base(data), data.get("rows", []), data["settings"]["boundaries"]
    panels = [(r, bd) for r in rows for bd in boundaries if profiled_sides(r, bd, base)]
    if not panels:
        return []
    title = f"where the time goes ({data['device_name']})"
    if len(panels) > MAX_KERNEL_PANELS:
        title += f"; the first {MAX_KERNEL_PANELS} of {len(panels)} profiled runs (the tables list all)"
    plot_kernel_profiles(panels[:MAX_KERNEL_PANELS], kernel_plot_path(path), base, data.get("device", "cuda"), title)
    return [kernel_plot_path(path)]


def plot_kernel_profiles(panels: list[tuple[OpRow, str]], path: str, base: str, device: str, title: str) -> None:
    """One panel per profiled (row, boundary): a horizontal bar per side, stacked by its largest kernels
    (one colour per kernel name across all panels, the rest grey), so the sides' stages line up."""
    plt = pyplot()
    top = 6
    panel_sides = [profiled_sides(r, bd, base) for r, bd in panels]
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
        ax.set_title(f"{r.op} {r.policy}, {shape_label(r)}: {what}", fontsize=9)
    unit = "kernel" if device == "cuda" else "operator"
    axes[-1, 0].set_xlabel(f"ms per {unit}, summed over launches (grey: the other {unit}s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in names]
    fig.legend(handles, [n[:60] for n in names], fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.suptitle(title, fontsize=10, y=1 - 0.12 / height, va="top")
    save(plt, fig, path, rect=(0, legend_in / height, 1, 1))    # tight_layout makes room for the suptitle itself
