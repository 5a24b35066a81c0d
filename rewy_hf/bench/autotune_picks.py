"""Forgetting Triton's autotune picks between the op bench's shapes, and reading them back.

Many of FLA's autotune keys leave out B and T, so a pick made at one shape would be kept at another
where a different config is faster; the bench forgets every pick before each shape, so each runs what
a process training at that shape alone would (docs/bench.md). ``picks`` reads back what the autotuners
chose, so that a row says which launch config each kernel ran with."""

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
