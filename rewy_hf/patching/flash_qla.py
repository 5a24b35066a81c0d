"""FlashQLA beside patched GDN layers: what ``patch_model`` tells the user.

FLA 0.6.0 sends ``chunk_gated_delta_rule`` (forward and backward) to
FlashQLA's TileLang kernels when the ``flash-qla`` package is installed, the
GPU is Hopper or SM100 and ``FLA_FLASH_QLA`` is not ``0``; FlashQLA's GDN
backward is faster than rewy's Triton kernels at most shapes
(docs/performance.md). Under ``backend="auto"`` rewy routes such calls to
FlashQLA itself (kernels/flash_qla_route.py), inside its own compile-friendly
boundary, so patching costs nothing there and ``patch_model`` notes the
routing. With ``backend="triton"`` (or ``"torch"``) the patched layers keep
rewy's kernels, slower than what FLA would run, and ``patch_model`` warns.
Detecting FLA's dispatch goes through FLA's own backend class, which reads the
same package, device and environment checks FLA uses.
"""

from __future__ import annotations

import importlib.util

from ..kernels.vocabulary import REPORT_OPS

GDN_OP = REPORT_OPS["gdn"]          # the patched layers' op, as the patch report names it

ROUTED_NOTE = (
    "rewy-hf: flash-qla is installed and runs on this GPU: under backend='auto' the {n} patched GDN layer(s) run "
    "FlashQLA's kernels through rewy's boundary (no graph break under torch.compile) wherever FlashQLA serves the "
    "call (bf16 / fp16, K = V = 128, no allow_neg_eigval; faster there at every shape measured, "
    "rewy_hf/kernels/flash_qla_route.py), rewy's Triton kernels elsewhere; the dispatch report's 'routes' says where each call went and why. backend='triton' keeps rewy's "
    "kernels throughout."
)

WARNING = (
    "rewy-hf: FLA runs Gated DeltaNet through FlashQLA on this machine (flash-qla is installed and "
    "FLA_FLASH_QLA is not 0). FlashQLA's GDN backward is faster than rewy's kernels there (docs/performance.md), "
    "and with backend={backend!r} the {n} patched GDN layer(s) stay on rewy's kernels here, so they will likely "
    "train slower than unpatched. Patch with backend='auto' where rewy can route those calls to FlashQLA (an SM90 "
    "or SM100/SM103 GPU), undo it with "
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


def rewy_routes_gdn_to_flash_qla() -> bool:
    """Whether ``backend="auto"`` can send GDN calls to FlashQLA in this process (package and GPU)."""
    import torch

    if importlib.util.find_spec("flash_qla") is None or not torch.cuda.is_available():
        return False
    from ..kernels.flash_qla_route import environment_reason

    return environment_reason("cuda", torch.cuda.current_device()) is None


def gdn_note(n: int, backend: str) -> tuple[str, bool] | None:
    """What ``patch_model`` says about FlashQLA after patching ``n`` GDN layers, and whether it is a
    warning (training slower than unpatched) or a note; None: nothing to say."""
    if backend == "auto" and rewy_routes_gdn_to_flash_qla():
        return ROUTED_NOTE.format(n=n), False
    if flash_qla_serves_gdn():
        return WARNING.format(n=n, backend=backend), True
    return None
