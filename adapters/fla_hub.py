"""FLA-hub layers: DeltaNet, GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2.

Each layer module imports FLA's chunk op by its public name (the same as
rewy's, kernels/vocabulary.py) and calls it with FLA's own signature, which
rewy's ops share, so the call passes through unchanged. Every ``fla.models``
model built on these layers is served by them.
"""

from __future__ import annotations

from rewy_hf import ops

from ..kernels.vocabulary import names_of
from .base import Adapter, keyword_call

# Per delta-rule family: FLA's layer module and its layer class.
_LAYERS = (
    ("delta_rule", "fla.layers.delta_net", "DeltaNet"),
    ("gdn", "fla.layers.gated_deltanet", "GatedDeltaNet"),
    ("kda", "fla.layers.kda", "KimiDeltaAttention"),
    ("gdn2", "fla.layers.gdn2", "GatedDeltaNet2"),
)


def _adapter(family: str, module: str, layer_class: str) -> Adapter:
    names = names_of(family)
    return Adapter(source="fla", op=names.report, layer_classes=(f"{module}.{layer_class}",),
                   site=f"{module}:{names.public}", call=keyword_call(getattr(ops, names.public)))


ADAPTERS = tuple(_adapter(*layer) for layer in _LAYERS)
