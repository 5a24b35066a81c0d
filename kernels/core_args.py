"""What one delta-rule core call receives, in the form both backends take.

The public ops (rewy_hf/ops.py) validate shapes and apply the gate and beta
activations; what reaches the core is this record: activated tensors in FLA's
token layout ``[B, T, heads, D]`` and the call's settings. The same record
travels through the eager autograd Function and through the custom op used
under ``torch.compile`` (core.py), so the two paths run the same code.

The custom ops take the record flattened, as positional arguments: its
tensors (``TENSOR_FIELDS``), then its settings (``SETTING_FIELDS``), in field
order. ``tensors()``, ``settings()`` and ``from_flat`` are the only places that
order is spelled, so adding a field touches the dataclass alone (and the custom
ops' signatures, which core.py checks against these names at import).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class CoreArgs:
    """q, k [B, T, H, K]; v [B, T, HV, V]; g None (DeltaNet), [B, T, HV] (GDN) or
    [B, T, HV, K] (KDA, GDN2); beta [B, T, HV] or GDN2's erase gate [B, T, H, K];
    w None or GDN2's write gate [B, T, H, V]; h0 None or the initial state in the
    caller's layout ([N, HV, K, V], or [N, HV, V, K] with ``state_v_first``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor
    w: torch.Tensor | None
    h0: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    scale: float
    family: str              # the delta-rule family (vocabulary.FAMILIES)
    policy: str              # vocabulary.POLICIES
    state_v_first: bool
    qk_l2norm: bool          # q and k are normalised inside the core (the Triton backend only)
    safe_gate: bool          # FLA's faster KDA/GDN2 intra kernel for gates >= -5; same math
    report_as: str = ""      # the dispatch report's op name when a patched layer made the call
    why: str = ""            # why ``backend="auto"`` chose this call's backend, where it weighed a peer

    def tensors(self) -> tuple:
        """The tensor fields (``TENSOR_FIELDS``), None where absent."""
        return tuple([getattr(self, name) for name in TENSOR_FIELDS])

    def settings(self) -> tuple:
        """The non-tensor fields (``SETTING_FIELDS``)."""
        return tuple([getattr(self, name) for name in SETTING_FIELDS])

    @classmethod
    def from_flat(cls, tensors: Sequence, settings: Sequence) -> "CoreArgs":
        """The record from ``tensors()`` and ``settings()`` (or the custom ops' arguments in that order)."""
        if len(tensors) != len(TENSOR_FIELDS) or len(settings) != len(SETTING_FIELDS):
            raise ValueError(f"CoreArgs takes {len(TENSOR_FIELDS)} tensors {TENSOR_FIELDS} and "
                             f"{len(SETTING_FIELDS)} settings {SETTING_FIELDS}, got {len(tensors)} and {len(settings)}")
        # Positional: the two groups together are the fields in order (checked below the class).
        return cls(*tensors, *settings)

    @property
    def sequences(self) -> int:
        return self.q.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    def state_shape(self) -> tuple:
        """[N, HV, K, V] in the caller's layout."""
        K, HV, V = self.q.shape[-1], self.v.shape[2], self.v.shape[-1]
        return (self.sequences, HV, V, K) if self.state_v_first else (self.sequences, HV, K, V)


def _is_tensor_field(f: dataclasses.Field) -> bool:
    # Annotations are strings here (``from __future__ import annotations``).
    return str(f.type).startswith("torch.Tensor")


TENSOR_FIELDS = tuple(f.name for f in dataclasses.fields(CoreArgs) if _is_tensor_field(f))
SETTING_FIELDS = tuple(f.name for f in dataclasses.fields(CoreArgs) if not _is_tensor_field(f))
if TENSOR_FIELDS + SETTING_FIELDS != tuple(f.name for f in dataclasses.fields(CoreArgs)):
    raise TypeError(f"CoreArgs must list its tensor fields {TENSOR_FIELDS} before its settings {SETTING_FIELDS}: "
                    "the custom ops take them in that order")
# The tensors with a gradient, in the order a backend's ``backward`` returns them (the packed bounds have none).
GRADIENT_FIELDS = tuple(name for name in TENSOR_FIELDS if name != "cu_seqlens")


def gradients_by_field(grads: Sequence) -> tuple:
    """A backend's gradients (in ``GRADIENT_FIELDS`` order) as one entry per tensor field, None for the
    tensors without a gradient: what the autograd boundary returns for ``tensors()``."""
    by_name = dict(zip(GRADIENT_FIELDS, grads))
    return tuple(by_name.get(name) for name in TENSOR_FIELDS)
