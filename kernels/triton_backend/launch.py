"""Launching an autotuned Triton kernel without its Python wrappers once it is tuned.

A launch through Triton's autotuner costs about 0.12 ms of host Python:
FLA's kernels sit under ``triton.heuristics`` and FLA's caching autotuner,
which build the autotune key (a ``str`` of every tensor's dtype) twice, merge
argument dicts three times and then call the jit function. A DeltaNet / GDN
backward at H = 16 launches five such kernels in about 1 ms of GPU time, so
without this the host, not the GPU, would set its pace.

``launch(kernel, grid, **kwargs)`` does what ``kernel[grid](**kwargs)`` does.
When the kernel's autotuner already holds a pick for this call's key, it
computes the heuristics, looks the pick up under the same key the autotuner
would build, and calls the jit function with it; otherwise (first call of a
key, forgotten picks, a config with a pre-hook, a kernel of another shape)
it takes the ordinary path, which tunes and stores the pick. The jit
function's own argument binding and specialization run in both cases, so the
compiled kernel is the one the ordinary path would launch.

The key is built the way Triton 3.x's ``Autotuner.run`` builds it; after the
first ordinary launch of a kernel, ``launch`` checks that its key is the one
the autotuner stored, and if not (another Triton version), it warns and never
takes the direct path for that kernel. The outputs are bit for bit those of
the ordinary launch (the same kernel, the same config).
"""

from __future__ import annotations

import warnings
import weakref

from triton.runtime.autotuner import Autotuner, Heuristics


class _Plan:
    """A kernel's layers: heuristics (outermost first), its autotuner, and the jit function under them."""

    def __init__(self, heuristics: list, tuner: Autotuner, jit):
        self.heuristics = heuristics
        self.tuner = tuner
        self.jit = jit
        self.names = frozenset(tuner.arg_names)
        self.verified = False       # the key rule matched the autotuner's own once
        self.usable = True

    def key(self, args: dict) -> tuple:
        # As Triton's Autotuner.run: the key arguments' values, then every tensor's dtype in argument order.
        tracked = [v for k, v in args.items() if k in self.names]
        key = [args[k] for k in self.tuner.keys if k in args and k in self.names]
        key += [_dtype_text(v.dtype) for v in tracked if hasattr(v, "dtype")]
        return tuple(key)


_DTYPE_TEXT: dict = {}


def _dtype_text(dtype) -> str:
    text = _DTYPE_TEXT.get(dtype)
    if text is None:
        text = _DTYPE_TEXT[dtype] = str(dtype)
    return text


def _plan(kernel) -> _Plan | None:
    """The layers of ``kernel`` when they are heuristics over one autotuner over the jit function
    (FLA's kernels) or an autotuner over it (rewy's); None for any other arrangement. Kept on the
    kernel object itself, so it lives and dies with it."""
    plan = getattr(kernel, "_rewy_direct_plan", False)
    if plan is not False:
        return plan
    heuristics, obj = [], kernel
    while isinstance(obj, Heuristics):
        heuristics.append(obj.values)
        obj = obj.fn
    plan = None
    if isinstance(obj, Autotuner) and not isinstance(obj.fn, (Autotuner, Heuristics)):
        plan = _Plan(heuristics, obj, obj.fn)
    try:
        kernel._rewy_direct_plan = plan
    except AttributeError:          # an object without a __dict__: planned again at each call
        pass
    return plan


# Each config's launch arguments, built once. Kept beside the configs, never on them: with
# TRITON_CACHE_AUTOTUNING=1 Triton writes every attribute of the autotuner's configs into its
# disk cache and rebuilds them with Config(**attributes), which refuses a name it does not know.
_CONFIG_KWARGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _config_kwargs(config) -> dict:
    cached = _CONFIG_KWARGS.get(config)
    if cached is None:
        cached = _CONFIG_KWARGS[config] = config.all_kwargs()
    return cached


def launch(kernel, grid, **kwargs):
    """``kernel[grid](**kwargs)``; once a pick is made for this call's key, the jit function is
    called with that pick directly."""
    plan = _plan(kernel)
    if plan is None or not plan.usable:
        return kernel[grid](**kwargs)
    args = dict(kwargs)
    for values in plan.heuristics:
        for name, rule in values.items():
            args[name] = rule(args)
    tuner = plan.tuner
    key = None
    if len(tuner.configs) == 1:
        config = tuner.configs[0]
    else:
        key = plan.key(args)
        config = tuner.cache.get(key) if plan.verified else None
    if config is None or config.pre_hook is not None:
        out = kernel[grid](**kwargs)
        if key is not None and not plan.verified:
            # the ordinary path stored its pick: under our key if the two key rules agree
            if key in tuner.cache:
                plan.verified = True
            else:
                plan.usable = False
                warnings.warn(f"rewy's direct launch: the autotuner of {getattr(tuner.base_fn, '__name__', tuner)} "
                              "stores its picks under another key than rewy rebuilds (another Triton version?); "
                              "its launches keep going through the autotuner", RuntimeWarning, stacklevel=2)
        return out
    tuner.best_config = config
    return plan.jit.run(grid=grid, warmup=False, **args, **_config_kwargs(config))
