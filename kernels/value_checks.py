"""Checks of input values the core makes inside its autograd boundary (core.py).

They read tensor values (a host sync on GPU), which traced code around the
core must not, so the public ops leave them to the core: the packed bounds,
and the opt-in NaN / Inf check. rewy_hf/validation.py exports both with the
ops' other checks.
"""

from __future__ import annotations

import torch

from .errors import InputValidationError
from .settings import CHECK_FINITE, check_finite_enabled


def check_cu_seqlens_values(cu_seqlens, T: int) -> None:
    """The bounds themselves: from 0 to T, never decreasing (a device sync on GPU)."""
    if cu_seqlens is None:
        return
    if cu_seqlens.device.type == "meta":
        raise InputValidationError("`cu_seqlens` is on the meta device, but the core needs its values (the "
                                   "sequence bounds); pass it on the CPU or the inputs' device.")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise InputValidationError(
            f"`cu_seqlens` must start at 0, end at T={T} and never decrease, got {cu if len(cu) < 12 else cu[:12] + ['...']}."
        )


def check_finite(reset_gate: str | None = None, **tensors) -> None:
    """Opt-in (REWY_HF_CHECK_FINITE=1): a full pass over the inputs, so off by default.

    ``reset_gate`` names the log-gate, which may hold -inf (a hard reset of the state)."""
    if not check_finite_enabled():
        return
    for name, x in tensors.items():
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            continue
        ok = torch.isfinite(x) | (x == float("-inf")) if name == reset_gate else torch.isfinite(x)
        if not ok.all():
            bad = (~ok).sum().item()
            raise InputValidationError(
                f"`{name}` has {bad} non-finite values (NaN or Inf); {CHECK_FINITE.name}=1 checks inputs before the op."
            )
