"""The triton backend (CUDA): FLA 0.6.0's forward stages, rewy's ReWY backward kernels.

One forward and one backward (function.py) run both gate kinds: the scalar
gate (scalar_gate/: DeltaNet, whose gate is zero, and GDN) and the vector gate
(vector_gate/: KDA, GDN2). ``forward``, ``backward`` and ``saved_like`` take a ``CoreArgs``
record, as the torch backend's do (kernels/core.py calls them). Shared launch
helpers live beside it: launch.py (direct launches of tuned kernels),
state_launch.py and state_checkpoints.py (FLA's state recurrences, launched
and segmented by rewy), packed_builds.py (every launch variant a packed call can reach,
built at the first packed call), chunks.py, occupancy.py, tiles.py.
"""

from __future__ import annotations

from ..core_args import CoreArgs
from ..vocabulary import gate_kind
from . import function
from .scalar_gate.stages import ScalarGate
from .vector_gate.stages import VectorGate

__all__ = ["forward", "backward", "saved_like", "normalised_qk"]


# Whether ``backward`` reads the gate's values (else the core keeps a stand-in in their place):
# its backward works from the gate's chunk cumsum (``g2``) that its forward saved.
BACKWARD_READS_GATE = False


def _stages(a: CoreArgs):
    """The stages of the call's gate kind (vocabulary.py): the scalar ones serve DeltaNet too."""
    return VectorGate if gate_kind(a.family) == "vector" else ScalarGate


def forward(a: CoreArgs):
    return function.forward(_stages(a), a)


def backward(a: CoreArgs, saved: list, do, dht):
    return function.backward(_stages(a), a, saved, do, dht)


def saved_like(a: CoreArgs, dynamic_size):
    return function.saved_like(_stages(a), a, dynamic_size)


def normalised_qk(a: CoreArgs) -> tuple[int, int] | None:
    """Where the normalised q and k are in ``forward``'s saved list (with ``qk_l2norm``), else None:
    the backward then needs only those, not the raw q and k."""
    if not a.qk_l2norm:
        return None
    names = function.saved_names(_stages(a), a)
    return names.index("q"), names.index("k")
