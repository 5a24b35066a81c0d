"""The relative error the bench, verify, the demo, the benchmark scripts and the kernel tests
measure: ||x - ref|| / ||ref||, in float64.

A zero reference gives 0 only when x is zero too, else infinity, so that an
all-zero reference can never make a wrong output pass a tolerance. A NaN or
infinity anywhere in x or ref gives infinity too: a NaN error would pass
``max(errors) < tol`` whenever another error came first (max skips NaNs
after the first element), and an unwritten, NaN-filled output must fail.
"""

from __future__ import annotations

import math

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``x`` against ``ref`` (any shapes that subtract), in float64."""
    x, ref = x.detach().double(), ref.detach().double()
    ref_norm, diff = ref.norm().item(), (x - ref).norm().item()
    if not (math.isfinite(ref_norm) and math.isfinite(diff)):
        return math.inf
    if ref_norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref_norm
