"""The loss plot of a recipe run (``loss_curve.png``): the loss per step, and under it, on the same step
axis, the learning rate and the gradient norm, all under a title that names the run and its settings.

Drawn with matplotlib when it is installed (the optional ``train`` extra); otherwise by the built-in
renderer (``builtin_plot``, nothing beyond zlib), so a plot is always written.
"""

from __future__ import annotations

import math
import os
import textwrap

from . import builtin_plot

#: (metrics.jsonl key, panel title), top to bottom. The gradient norm is the total norm that
#: clip_grad_norm_ returns, taken before it clips.
PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm (before clipping)"))
#: characters per title line before it wraps
TITLE_WIDTH = 100


def series(records: list[dict]) -> tuple[list[int], list[tuple[str, list[float]]]]:
    """The steps, and (panel title, one value per step) for each panel; NaN where a record lacks the key."""
    steps = [r["step"] for r in records]
    return steps, [(label, [float(r.get(key, math.nan)) for r in records]) for key, label in PANELS]


def plot_loss(records: list[dict], path: str | os.PathLike, title: str = "") -> str:
    """Write the plot of ``records`` (metrics.jsonl's) to ``path``; returns which renderer drew it
    ("matplotlib" or "builtin")."""
    try:
        figure = loss_figure(records, title)
    except ImportError:
        steps, values = series(records)
        builtin_plot.write_png(steps, values, path, title)
        return "builtin"
    figure.savefig(path)
    return "matplotlib"


def loss_figure(records: list[dict], title: str = ""):
    """The matplotlib Figure of the plot (ImportError without matplotlib). A bare Figure, not pyplot's:
    drawing it changes no process-wide matplotlib state."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    steps, values = series(records)
    fig = Figure(figsize=(9, 7.5), dpi=100, layout="constrained")
    axes = fig.subplots(len(values), 1, sharex=True, height_ratios=[3] + [1] * (len(values) - 1))
    for n, (ax, (label, ys), colour) in enumerate(zip(axes, values, ("C0", "C1", "C2"))):
        ax.plot(steps, ys, lw=1.5, color=colour, marker="." if len(steps) <= 50 else None)
        ax.set_title(label, loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5 if n == 0 else 4))
        # Plain tick values (no offset such as "+5.5" to add in one's head); a learning rate of 3e-4
        # gets its power of ten once, above the axis.
        formatter = ScalarFormatter(useOffset=False, useMathText=True)
        formatter.set_powerlimits((-3, 4))
        ax.yaxis.set_major_formatter(formatter)
        if n == 0:
            _mark_ends(ax, steps, ys)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle("\n".join(textwrap.fill(line, TITLE_WIDTH) for line in title.splitlines()), fontsize=10)
    return fig


def _mark_ends(ax, steps: list[int], losses: list[float]) -> None:
    """The lowest and the last loss, marked and named in the legend."""
    finite = [(s, v) for s, v in zip(steps, losses) if math.isfinite(v)]
    if not finite:
        return
    best_step, best = min(finite, key=lambda p: p[1])
    last_step, last = finite[-1]
    ax.plot([best_step], [best], "o", color="C3", label=f"lowest {best:.4f} (step {best_step})")
    ax.plot([last_step], [last], "s", color="C0", mfc="none", label=f"last {last:.4f} (step {last_step})")
    ax.legend(loc="upper right", fontsize=8)
