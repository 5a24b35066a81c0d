"""FLA-hub layers: DeltaNet, GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2.

Each layer module imports FLA's chunk op by name and calls it with FLA's own
signature, which rewy's ops share, so the call passes through unchanged. Every
``fla.models`` model built on these layers is served by them.
"""

from __future__ import annotations

from rewy_hf import ops

from .base import Adapter, keyword_call

ADAPTERS = (
    Adapter(family="fla", op="delta_rule", layer_classes=("fla.layers.delta_net.DeltaNet",),
            site="fla.layers.delta_net:chunk_delta_rule", call=keyword_call(ops.chunk_delta_rule)),
    Adapter(family="fla", op="gated_delta_rule", layer_classes=("fla.layers.gated_deltanet.GatedDeltaNet",),
            site="fla.layers.gated_deltanet:chunk_gated_delta_rule",
            call=keyword_call(ops.chunk_gated_delta_rule)),
    Adapter(family="fla", op="kda", layer_classes=("fla.layers.kda.KimiDeltaAttention",),
            site="fla.layers.kda:chunk_kda", call=keyword_call(ops.chunk_kda)),
    Adapter(family="fla", op="gdn2", layer_classes=("fla.layers.gdn2.GatedDeltaNet2",),
            site="fla.layers.gdn2:chunk_gdn2", call=keyword_call(ops.chunk_gdn2)),
)
