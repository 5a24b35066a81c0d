"""Kept op-level rows read back: the JSON that ``OpRow.to_json`` writes (rewy_hf/bench/rows.py) as an
``OpRow`` again, also from files written before a field existed; the keys a row holds beyond the
installed ones (the further sides, kernel profiles and autotune picks this package adds) go to its
``more``, which ``to_json`` writes back as they are."""

from __future__ import annotations

from dataclasses import fields

from rewy_hf.bench.config import BOUNDARIES
from rewy_hf.bench.rows import SECOND_CHECKS, Check, OpRow, Timing
from rewy_hf.op_inputs import Shape

# OpRow's fields that are not one JSON key of their own.
NESTED = ("shape", "check", *SECOND_CHECKS, "baseline", "rewy", "speedup", "more")


def check_of(d: dict, prefix: str = "") -> Check:
    return Check(**{f.name: d[prefix + f.name] for f in fields(Check) if prefix + f.name in d})


def timing_of(d: dict, side: str) -> Timing:
    """``side``: "baseline_" or "rewy_" for a row's own sides, "" for a further side's own entry."""
    timed = [bd for bd in BOUNDARIES if f"{side}{bd}_ms" in d]
    return Timing(ms={bd: d[f"{side}{bd}_ms"] for bd in timed},
                  rounds={bd: d.get(f"{side}{bd}_rounds") or [] for bd in timed},
                  peak_mb=d.get(side + "peak_mb"), error=d.get(side + "error"))


def speedups_of(d: dict) -> dict[str, float | None]:
    return {bd: d[f"speedup_{bd}"] for bd in BOUNDARIES if f"speedup_{bd}" in d}


def op_row(d: dict) -> OpRow:
    """One row of a kept op-level run."""
    shape = Shape(d["B"], d["T"], d["H"], d["K"], d["V"], d.get("N", 0))
    row = OpRow(**{f.name: d[f.name] for f in fields(OpRow) if f.name not in NESTED and f.name in d},
                shape=shape, baseline=timing_of(d, "baseline_"), rewy=timing_of(d, "rewy_"), speedup=speedups_of(d))
    row.check = check_of(d) if "check_rule" in d or "err_rewy" in d else None
    for name in SECOND_CHECKS:
        if f"{name}_ok" in d:
            setattr(row, name, check_of(d, name + "_"))
    row.more = {k: v for k, v in d.items() if k not in row.to_json()}
    return row
