"""transformers models whose linear-attention layer is Kimi Delta Attention.

Kimi-Linear, Bailing-hybrid and GLM-5-Next call ``chunk_kimi_delta_attention``
in their modeling module (``recurrent_kimi_delta_attention`` for a decode
step, ``causal_conv1d_fn`` for the short convolution) with the gate already activated by the layer (its
forget-gate module applies ``-exp(A_log) * softplus(. + dt_bias)``), so the
call maps to ``chunk_kda`` without ``use_gate_in_kernel``.
"""

from __future__ import annotations

from .transformers_common import hf_adapters

_MODELS = (
    ("kimi_linear", "KimiLinearDeltaAttention"),
    ("bailing_hybrid", "BailingHybridDeltaAttention"),
    ("glm5_next", "Glm5NextTextLinearAttention"),
)

ADAPTERS = hf_adapters(_MODELS, "kda", "chunk_kimi_delta_attention", decode_attr="recurrent_kimi_delta_attention")
