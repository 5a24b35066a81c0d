"""transformers models whose linear-attention layer is Gated DeltaNet.

Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid, LaRA-mini and Qwen4-exp all
call ``torch_chunk_gated_delta_rule`` in their modeling module (and
``torch_recurrent_gated_delta_rule`` for a decode step, ``causal_conv1d_fn`` for the short convolution); see
transformers_common for the call convention.
"""

from __future__ import annotations

from .transformers_common import hf_adapters

_MODELS = (
    ("qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ("qwen3_next", "Qwen3NextGatedDeltaNet"),
    ("olmo_hybrid", "OlmoHybridGatedDeltaNet"),
    ("lara_mini", "LaraMiniGatedDeltaNet"),
    ("qwen4_exp", "Qwen4ExpTextGatedDeltaNet"),
)

ADAPTERS = hf_adapters(_MODELS, "gdn", "torch_chunk_gated_delta_rule", decode_attr="torch_recurrent_gated_delta_rule")
