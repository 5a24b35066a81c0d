"""Checks that a Triton family's ``saved_like`` (the custom op's fake implementation) describes
the tensors its real forward saves: dtype, rank, every static dim, dense layout.

``watch_saved_like(monkeypatch)`` wraps ``function.forward`` so that every real forward a test
runs (under the CPU interpreter) is checked. Every size is a function of the input shapes
(packed calls: the bounds of ``function.packed_chunks`` and ``state_checkpoints.packed_count``),
so every dim is compared.
"""

from __future__ import annotations

import dataclasses

import torch

from rewy_hf.kernels.triton_backend import function


def check_saved_like(family, a, saved) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        fake = {f.name: mode.from_tensor(getattr(a, f.name)) for f in dataclasses.fields(a)
                if isinstance(getattr(a, f.name), torch.Tensor)}
        fakes = function.saved_like(family, dataclasses.replace(a, **fake), env.create_unbacked_symint)
    names = function.saved_names(family, a)
    assert len(fakes) == len(saved) == len(names), (names, len(fakes), len(saved))
    for name, f, r in zip(names, fakes, saved):
        assert f.dtype == r.dtype and f.dim() == r.dim(), (name, f.dtype, r.dtype, f.shape, r.shape)
        for d, (fd, rd) in enumerate(zip(f.shape, r.shape)):
            if isinstance(fd, int):
                assert fd == rd, (name, d, tuple(f.shape), tuple(r.shape))
        assert r.is_contiguous(), name


def watch_saved_like(monkeypatch) -> list:
    """Wrap ``function.forward``; returns the list of checked calls (so a test can see it ran)."""
    checked = []
    real = function.forward

    def forward(family, a):
        o, ht, saved = real(family, a)
        check_saved_like(family, a, saved)
        checked.append(family.__name__)
        return o, ht, saved

    monkeypatch.setattr(function, "forward", forward)
    return checked
