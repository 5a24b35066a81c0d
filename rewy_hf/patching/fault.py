"""A deliberate fault that proves checks like ``rewy-hf parity`` can fail.

Set ``REWY_HF_TEST_FAULT=grad_scale=<factor>`` (optionally ``@<op>``, e.g.
``grad_scale=1.5@kda``) and every rewy-routed core call of that op scales the
gradient flowing back through its output by the factor, as a broken kernel
would. Never set this outside tests: rewy-hf warns once when it is active.
"""

from __future__ import annotations

import warnings

import torch

from ..settings import TEST_FAULT

_warned: set[str] = set()   # specs already announced in this process


def grad_fault(op: str) -> float | None:
    """The factor the fault scales ``op``'s gradients by, or None when no fault applies to it."""
    spec = TEST_FAULT.value()
    if not spec:
        return None
    kind, _, rest = spec.partition("=")
    text, _, only_op = rest.partition("@")
    try:
        factor = float(text)
    except ValueError:
        factor = None
    if kind != "grad_scale" or factor is None:
        raise ValueError(f"{TEST_FAULT.name}={spec!r} is not understood; use grad_scale=<factor> or "
                         f"grad_scale=<factor>@<op> (e.g. grad_scale=1.05@kda), or unset it")
    if only_op and only_op != op:
        return None
    if spec not in _warned:
        warnings.warn(f"{TEST_FAULT.name}={spec} is set: rewy-hf is deliberately corrupting gradients (test hook).",
                      RuntimeWarning, stacklevel=2)
        _warned.add(spec)
    return factor


def apply_grad_fault(out: torch.Tensor, op: str) -> None:
    factor = grad_fault(op)
    if factor is not None and out.requires_grad:
        out.register_hook(lambda grad: grad * factor)
