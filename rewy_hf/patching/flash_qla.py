"""FlashQLA: detecting where FLA runs Gated DeltaNet through FlashQLA's kernels.

FLA 0.6.0 sends ``chunk_gated_delta_rule`` (forward and backward) to
FlashQLA's TileLang kernels when the ``flash-qla`` package is installed, the
GPU is Hopper or SM100 and ``FLA_FLASH_QLA`` is not ``0``. There FlashQLA's
GDN backward is faster than rewy's (docs/performance.md has the numbers), so
patching GDN layers makes training slower, and ``patch_model`` says so.
Feature detection goes through FLA's own backend class, which reads the same
package, device and environment checks FLA uses to dispatch.
"""

from __future__ import annotations

import importlib.util

GDN_OP = "gated_delta_rule"

WARNING = (
    "rewy-hf: FLA runs Gated DeltaNet through FlashQLA on this machine (flash-qla is installed and "
    "FLA_FLASH_QLA is not 0). FlashQLA's GDN backward is faster than rewy's there (docs/performance.md), "
    "so the {n} patched GDN layer(s) will likely train slower than unpatched. Undo it with "
    "rewy_hf.unpatch_model(model, only={{...names...}}), or set FLA_FLASH_QLA=0 before importing FLA to "
    "compare against FLA's Triton kernels instead."
)


def flash_qla_serves_gdn() -> bool:
    """Whether FLA would dispatch chunk_gated_delta_rule to FlashQLA on this machine."""
    if importlib.util.find_spec("flash_qla") is None:      # the common case: no FLA import needed to say no
        return False
    try:
        from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend
        from fla.utils import IS_NVIDIA_HOPPER, IS_NVIDIA_SM100
    except ImportError:          # another FLA layout, or no FLA: nothing dispatches to FlashQLA
        return False
    return bool((IS_NVIDIA_HOPPER or IS_NVIDIA_SM100) and FlashQLABackend.can_use())
