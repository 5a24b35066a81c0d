"""Compare recipe runs: loss curves against a reference run, speed, memory, dispatch.

    python tools/compare_runs.py DIR REF OTHER [OTHER ...] [--png out.png]

DIR holds NAME.metrics.jsonl (and NAME.dispatch.json) per run, as written by
tools/gpu_recipe_runs.sh. Step times are medians over steps after the third
(the first steps include compilation and autotuning).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(d: Path, name: str):
    recs = [json.loads(line) for line in (d / f"{name}.metrics.jsonl").read_text().splitlines() if line.strip()]
    disp = d / f"{name}.dispatch.json"
    ranks = json.loads(disp.read_text()).get("dispatch_per_rank", []) if disp.exists() else []
    return recs, ranks


def summary(recs, ranks) -> dict:
    steady = recs[3:] or recs
    bwd = [sum(op["optimized_backward_calls"] for op in r.get("ops", {}).values()) for r in ranks]
    return {"steps": len(recs), "final_loss": recs[-1]["loss"],
            "step_s": statistics.median(r["step_time_s"] for r in steady),
            "tok_s": statistics.median(r["tokens_per_s"] for r in steady),
            "peak_gb": max((r.get("peak_mem_gb", float("nan")) for r in recs), default=float("nan")),
            "rewy_backward_per_rank": bwd}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("ref")
    p.add_argument("others", nargs="+")
    p.add_argument("--png", type=Path)
    a = p.parse_args()
    ref, ref_ranks = load(a.dir, a.ref)
    rows = [(a.ref, ref, summary(ref, ref_ranks), 0.0, 0.0)]
    for name in a.others:
        recs, ranks = load(a.dir, name)
        n = min(len(recs), len(ref))
        diffs = [abs(recs[i]["loss"] - ref[i]["loss"]) for i in range(n)]
        rel = [d / abs(ref[i]["loss"]) for i, d in enumerate(diffs)]
        rows.append((name, recs, summary(recs, ranks), max(diffs), max(rel)))
    print(f"| run | steps | final loss | max abs loss diff vs {a.ref} | max rel | median step s | tokens/s "
          f"| peak GB | rewy backward calls per rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, _, s, d, r in rows:
        print(f"| {name} | {s['steps']} | {s['final_loss']:.4f} | {d:.4f} | {r:.2%} | {s['step_s']:.3f} "
              f"| {s['tok_s']:.0f} | {s['peak_gb']:.1f} | {s['rewy_backward_per_rank']} |")
    if a.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, recs, *_ in rows:
            ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label=name, lw=1.2)
        ax.set_xlabel("optimizer step"), ax.set_ylabel("training loss"), ax.legend(), ax.grid(alpha=.3)
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
        print(f"plot: {a.png}")


if __name__ == "__main__":
    main()
