"""transformers models whose linear-attention layer is Kimi Delta Attention.

Kimi-Linear, Bailing-hybrid and GLM-5-Next call ``chunk_kimi_delta_attention``
in their modeling module with the gate already activated by the layer (its
forget-gate module applies ``-exp(A_log) * softplus(. + dt_bias)``), so the
call maps to ``chunk_kda`` without ``use_gate_in_kernel``.
"""

from __future__ import annotations

from rewy_hf import ops

from .base import Adapter
from .transformers_common import hf_core_call

_MODELS = (
    ("kimi_linear", "KimiLinearDeltaAttention"),
    ("bailing_hybrid", "BailingHybridDeltaAttention"),
    ("glm5_next", "Glm5NextTextLinearAttention"),
)

ADAPTERS = tuple(
    Adapter(
        family=model,
        op="kda",
        layer_classes=(f"transformers.models.{model}.modeling_{model}.{cls}",),
        site=f"transformers.models.{model}.modeling_{model}:chunk_kimi_delta_attention",
        call=hf_core_call(ops.chunk_kda),
    )
    for model, cls in _MODELS
)
