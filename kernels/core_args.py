"""What one delta-rule core call receives, in the form both backends take.

The public ops (rewy_hf/ops.py) validate shapes and apply the gate and beta
activations; what reaches the core is this record: activated tensors in FLA's
token layout ``[B, T, heads, D]`` and the call's settings. The same record
travels through the eager autograd Function and through the custom op used
under ``torch.compile`` (core.py), so the two paths run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FAMILIES = ("delta_rule", "gdn", "kda", "gdn2")


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
    family: str
    policy: str
    state_v_first: bool
    qk_l2norm: bool          # q and k are normalised inside the core (the Triton backend only)
    safe_gate: bool          # FLA's faster KDA/GDN2 intra kernel for gates >= -5; same math
    report_as: str = ""      # the dispatch report's op name when a patched layer made the call
    why: str = ""            # why ``backend="auto"`` chose this call's backend, where it weighed a peer

    @property
    def sequences(self) -> int:
        return self.q.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    def state_shape(self) -> tuple:
        """[N, HV, K, V] in the caller's layout."""
        K, HV, V = self.q.shape[-1], self.v.shape[2], self.v.shape[-1]
        return (self.sequences, HV, V, K) if self.state_v_first else (self.sequences, HV, K, V)
