"""Compare recipe runs: loss curves against a reference run, speed, memory, dispatch.

    python -m rewy_hf.training.compare_runs DIR REF OTHER [OTHER ...] [--png out.png]

DIR holds NAME.metrics.jsonl (a run's ``metrics.jsonl``) and, optionally,
NAME.dispatch.json (its ``dispatch_report.json``) per run. Prints one Markdown
table row per run. Step times are medians over the steps after the third (the
first steps include compilation and autotuning).
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


def table(d: Path, ref_name: str, others: list[str]) -> tuple[list[str], list[tuple[str, list[dict]]]]:
    """The Markdown table lines, and each run's records (reference first) for the plot."""
    ref, ref_ranks = load(d, ref_name)
    rows = [(ref_name, ref, summary(ref, ref_ranks), 0.0, 0.0)]
    for name in others:
        recs, ranks = load(d, name)
        n = min(len(recs), len(ref))
        diffs = [abs(recs[i]["loss"] - ref[i]["loss"]) for i in range(n)]
        rel = [diff / abs(ref[i]["loss"]) for i, diff in enumerate(diffs)]
        rows.append((name, recs, summary(recs, ranks), max(diffs), max(rel)))
    lines = [f"| run | steps | final loss | max abs loss diff vs {ref_name} | max rel | median step s | tokens/s "
             f"| peak GB | rewy backward calls per rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, _, s, diff, rel in rows:
        lines.append(f"| {name} | {s['steps']} | {s['final_loss']:.4f} | {diff:.4f} | {rel:.2%} | {s['step_s']:.3f} "
                     f"| {s['tok_s']:.0f} | {s['peak_gb']:.1f} | {s['rewy_backward_per_rank']} |")
    return lines, [(name, recs) for name, recs, *_ in rows]


def plot(runs: list[tuple[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, recs in runs:
        ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label=name, lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rewy_hf.training.compare_runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="folder with NAME.metrics.jsonl (and NAME.dispatch.json) per run")
    p.add_argument("ref", help="the reference run's NAME")
    p.add_argument("others", nargs="+", help="the runs compared against it")
    p.add_argument("--png", type=Path, default=None, help="also draw the loss curves to this PNG (needs matplotlib)")
    a = p.parse_args(argv)
    try:
        lines, runs = table(a.dir, a.ref, a.others)
    except RunsError as exc:
        print(f"compare_runs: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if a.png:
        plot(runs, a.png)
        print(f"plot: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
