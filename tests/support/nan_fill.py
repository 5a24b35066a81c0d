"""Output buffers that start as NaN, so a tile a kernel fails to write cannot pass as zeros."""

from __future__ import annotations

import torch


def nan_filled(monkeypatch):
    """Every floating-point buffer made by ``Tensor.new_empty`` or ``torch.empty_like`` from here on
    (the allocations of the scalar-gate prestage and reverse walk) starts as NaN."""
    empty, empty_like = torch.Tensor.new_empty, torch.empty_like
    nan = lambda t: t.fill_(float("nan")) if t.is_floating_point() else t   # noqa: E731
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: nan(empty(self, *a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(empty_like(*a, **kw)))
