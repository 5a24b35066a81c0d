"""Compare recipe runs: loss curves against a reference run, speed, memory, dispatch.

    python $REPO/dev/compare_runs.py DIR REF OTHER [OTHER ...] [--png out.png]

DIR holds NAME.metrics.jsonl (a run's ``metrics.jsonl``) and, optionally,
NAME.dispatch.json (its ``dispatch_report.json``) per run. Prints one Markdown
table row per run: the loss gap to the reference at its worst step and at the
median step, and how many steps are within ``--within`` of it. Step times are
medians over the steps after the third (the first steps include compilation and
autotuning). The plot has the loss curves above and, below, each run's
relative loss difference from the reference per step, with the ``--within``
band drawn in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# Steps left out of the step-time medians: compilation and autotuning happen there.
WARM_STEPS = 3


class RunsError(ValueError):
    """A run's files are missing or unreadable; the message names the file and the fix."""


def load(d: Path, name: str) -> tuple[list[dict], list[dict]]:
    """A run's metrics records and its per-rank dispatch reports (empty without a dispatch file)."""
    metrics = d / f"{name}.metrics.jsonl"
    if not metrics.is_file():
        raise RunsError(f"{metrics} not found; copy the run's metrics.jsonl there as {name}.metrics.jsonl")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not recs:
        raise RunsError(f"{metrics} has no steps; pass a run that trained at least one step")
    disp = d / f"{name}.dispatch.json"
    ranks = json.loads(disp.read_text()).get("dispatch_per_rank", []) if disp.exists() else []
    return recs, ranks


def summary(recs: list[dict], ranks: list[dict]) -> dict:
    steady = recs[WARM_STEPS:] or recs
    bwd = [sum(op["optimized_backward_calls"] for op in r.get("ops", {}).values()) for r in ranks]
    return {"steps": len(recs), "final_loss": recs[-1]["loss"],
            "step_s": statistics.median(r["step_time_s"] for r in steady),
            "tok_s": statistics.median(r["tokens_per_s"] for r in steady),
            "peak_gb": max((r.get("peak_mem_gb", float("nan")) for r in recs), default=float("nan")),
            "rewy_backward_per_rank": bwd}


def relative_gaps(recs: list[dict], ref: list[dict]) -> list[float]:
    """Per step both runs logged, (loss - reference loss) / |reference loss|."""
    return [(r["loss"] - q["loss"]) / abs(q["loss"]) for r, q in zip(recs, ref)]


def table(d: Path, ref_name: str, others: list[str],
          within: float = 0.005) -> tuple[list[str], list[tuple[str, list[dict]]]]:
    """The Markdown table lines, and each run's records (reference first) for the plot."""
    ref, ref_ranks = load(d, ref_name)
    lines = [f"| run | steps | final loss | max abs loss diff vs {ref_name} | max rel | median rel "
             f"| steps within {within:.1%} | median step s | tokens/s | peak GB | rewy backward calls per rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(name: str, s: dict, gap_cells: str) -> str:
        return (f"| {name} | {s['steps']} | {s['final_loss']:.4f} | {gap_cells} | {s['step_s']:.3f} "
                f"| {s['tok_s']:.0f} | {s['peak_gb']:.1f} | {s['rewy_backward_per_rank']} |")

    lines.append(row(ref_name, summary(ref, ref_ranks), "- | - | - | -"))
    runs = [(ref_name, ref)]
    for name in others:
        recs, ranks = load(d, name)
        diff = max(abs(r["loss"] - q["loss"]) for r, q in zip(recs, ref))
        gaps = [abs(g) for g in relative_gaps(recs, ref)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        lines.append(row(name, summary(recs, ranks),
                         f"{diff:.4f} | {gaps[worst]:.2%} (step {recs[worst]['step']}) | "
                         f"{statistics.median(gaps):.2%} | {sum(g <= within for g in gaps)} / {len(gaps)}"))
        runs.append((name, recs))
    return lines, runs


def plot(runs: list[tuple[str, list[dict]]], path: Path, within: float = 0.005) -> None:
    import matplotlib

    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt

    # Curves that overlap at the loss's scale part in the lower panel, which shows the gaps themselves.
    fig, (ax, gap_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": (3, 2)})
    (ref_name, ref), *others = runs
    for name, recs in runs:
        ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label=name, lw=1.2)
    for i, (name, recs) in enumerate(others, 1):
        steps = [r["step"] for r in recs][:len(ref)]
        gap_ax.plot(steps, [100 * g for g in relative_gaps(recs, ref)], color=f"C{i}", lw=1.2, label=name)
    gap_ax.axhspan(-100 * within, 100 * within, color="0.85", zorder=0, label=f"within {within:.1%}")
    gap_ax.axhline(0, color="C0", lw=1)
    ax.set_ylabel("training loss")
    gap_ax.set_ylabel(f"loss vs {ref_name}, %")
    gap_ax.set_xlabel("optimizer step")
    ax.legend()
    gap_ax.legend(fontsize="small")
    for a in (ax, gap_ax):
        a.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compare_runs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="folder with NAME.metrics.jsonl (and NAME.dispatch.json) per run")
    p.add_argument("ref", help="the reference run's NAME")
    p.add_argument("others", nargs="+", help="the runs compared against it")
    p.add_argument("--png", type=Path, default=None, help="also draw the loss curves to this PNG (needs matplotlib)")
    p.add_argument("--within", type=float, default=0.5, metavar="PERCENT",
                   help="count the steps whose loss is within this many percent of the reference's (default 0.5)")
    a = p.parse_args(argv)
    if not 0 <= a.within < 100:
        p.error(f"--within must be a percentage from 0 to below 100, got {a.within}")
    try:
        lines, runs = table(a.dir, a.ref, a.others, a.within / 100)
    except RunsError as exc:
        print(f"compare_runs: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if a.png:
        plot(runs, a.png, a.within / 100)
        print(f"plot: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
