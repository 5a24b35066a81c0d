"""Test hooks: deliberate faults that prove checks like ``rewy-hf parity`` can fail.

Set ``REWY_HF_TEST_FAULT=grad_scale=<factor>`` (optionally ``@<op>``, e.g.
``grad_scale=1.5@kda``) and every rewy-routed core call of that op scales the
gradient flowing back through its output by the factor, as a broken kernel
would. Never set this outside tests: rewy-hf warns once when it is active.
"""

from __future__ import annotations

import os
import warnings

import torch

FAULT_ENV = "REWY_HF_TEST_FAULT"
_warned: set[str] = set()   # specs already announced in this process


def grad_fault(op: str) -> float | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    kind, _, rest = spec.partition("=")
    factor, _, only_op = rest.partition("@")
    if kind != "grad_scale" or (only_op and only_op != op):
        return None
    if spec not in _warned:
        warnings.warn(f"{FAULT_ENV}={spec} is set: rewy-hf is deliberately corrupting gradients (test hook).",
                      RuntimeWarning, stacklevel=2)
        _warned.add(spec)
    return float(factor)


def apply_grad_fault(out: torch.Tensor, op: str) -> None:
    factor = grad_fault(op)
    if factor is not None and out.requires_grad:
        out.register_hook(lambda grad: grad * factor)
