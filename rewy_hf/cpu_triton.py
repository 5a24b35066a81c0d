"""Running FLA-hub models on a machine without a GPU.

FLA's layers use Triton kernels for their short convolution and fused norms.
Without a GPU driver those kernels can only run under Triton's interpreter,
which must be switched on before the kernels are defined (before ``import
fla``), and whose autotuner cannot time configs, so each autotuned kernel is
cut down to its first config. FLA's own chunk ops still do not run there; a
patched layer's core is rewy's, and an unpatched one needs a reference core
(see rewy_hf.patching.reference_cores).
"""

from __future__ import annotations

import contextlib
import os
import sys

_PRUNED = False


def enable_cpu_interpreter() -> bool:
    """Turn on Triton's interpreter if there is no CUDA device. Returns whether
    it is (now) on. Refuses with a clear error if FLA was imported earlier."""
    import torch

    if torch.cuda.is_available():
        return False
    if os.environ.get("TRITON_INTERPRET") != "1" and "fla" in sys.modules:
        raise RuntimeError(
            "FLA was imported before rewy-hf could enable Triton's CPU interpreter; set TRITON_INTERPRET=1 in the "
            "environment (or call rewy_hf.cpu_triton.enable_cpu_interpreter() before importing fla)."
        )
    os.environ["TRITON_INTERPRET"] = "1"
    first_config_only()
    return True


def first_config_only() -> None:
    """Cut every Triton autotuner defined from now on to its first config.
    Also used by `rewy-hf verify` on CUDA, which checks correctness, not speed:
    compiling one config per kernel instead of every candidate is what keeps a
    cold first run to about a minute."""
    global _PRUNED
    if _PRUNED:
        return
    import triton.runtime.autotuner as autotuner

    original_init = autotuner.Autotuner.__init__

    def first_config_only(self, fn, arg_names, configs, *args, **kwargs):
        original_init(self, fn, arg_names, configs[:1], *args, **kwargs)
        # the whole list stays readable, for the GPU test that runs each listed config in turn
        self.listed_configs = list(configs)

    autotuner.Autotuner.__init__ = first_config_only
    _PRUNED = True


@contextlib.contextmanager
def only_config(kernel, config):
    """The autotuned ``kernel`` with ``config`` as its only config (its cache cleared, so that
    config runs), restored afterwards: how the launch-config sweep and the tests run one config."""
    saved = kernel.configs
    kernel.configs = [config]
    kernel.cache.clear()
    try:
        yield
    finally:
        kernel.configs = saved
        kernel.cache.clear()
