"""How many Triton kernels the process has compiled and how many autotune picks it holds.

A step that compiles or tunes a kernel waits for Triton (seconds, against a few hundred
milliseconds of work), so the packed bench records how much each step added: a slow step with
builds is a tuning stall, one without is not (docs/bench.md)."""

from __future__ import annotations

import gc


def built_and_tuned() -> tuple[int, int]:
    """(compiled kernels over every jit function, tuned picks over every autotuner) in the process.
    Walks the garbage collector's objects: tens of milliseconds, so call it outside timed work."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    built = tuned = 0
    for o in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__ through a weak proxy, and a proxy
        # whose referent died raises ReferenceError (one stopped a compiled side of the bench).
        kind = type(o)
        if issubclass(kind, JITFunction):
            built += sum(len(caches[0]) for caches in o.device_caches.values())
        elif issubclass(kind, Autotuner):
            tuned += len(o.cache)
    return built, tuned
