"""The triton backend (CUDA): FLA 0.6.0's forward stages, rewy's ReWY backward kernels.

One autograd skeleton (function.py) runs both op families: the scalar gate
(scalar_gate/: DeltaNet, GDN) and the vector gate (vector_gate/: KDA, GDN2).
Shared launch helpers live beside it: launch.py (direct launches of tuned
kernels), state_launch.py and state_checkpoints.py (FLA's state recurrences,
launched and segmented by rewy), chunks.py, occupancy.py, tiles.py.
"""

from .scalar_gate.stages import triton_gdn_core
from .vector_gate.stages import triton_gdn2_core, triton_kda_core

__all__ = ["triton_gdn_core", "triton_kda_core", "triton_gdn2_core"]
