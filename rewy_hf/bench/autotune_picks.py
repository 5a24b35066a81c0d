"""Forgetting Triton's autotune picks between the op bench's shapes.

Many of FLA's autotune keys leave out B and T, so a pick made at one shape would be kept at another
where a different config is faster; the bench forgets every pick before each shape, so each runs what
a process training at that shape alone would (docs/bench.md)."""

from __future__ import annotations

import sys

from triton.runtime.autotuner import Autotuner

# Modules whose autotuned kernels the op bench launches: FLA's and rewy's.
BENCH_MODULES = ("fla.", "rewy_hf.")


def autotuner_of(obj) -> Autotuner | None:
    """The autotuner inside a kernel object, also under ``triton.heuristics`` (FLA puts
    heuristics outside its autotuners); None for anything else."""
    for _ in range(4):                              # heuristics -> autotuner -> jit function
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def autotuners(prefixes: tuple[str, ...] = BENCH_MODULES) -> list[Autotuner]:
    """Every autotuner bound at module level in the loaded modules under ``prefixes``."""
    found: dict[int, Autotuner] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for obj in list(vars(module).values()):
            tuner = autotuner_of(obj)
            if tuner is not None:
                found[id(tuner)] = tuner
    return list(found.values())


def forget_picks(prefixes: tuple[str, ...] = BENCH_MODULES) -> int:
    """Clear the picks of every autotuner under ``prefixes``; returns how many there are.

    Their on-disk result cache (``cache_results``, TRITON_CACHE_AUTOTUNING) is switched
    off as well, since it would hand back the pick stored for the same key at an
    earlier shape instead of timing the configs again."""
    tuners = autotuners(prefixes)
    for tuner in tuners:
        tuner.cache.clear()
        tuner.cache_results = False
    return len(tuners)
