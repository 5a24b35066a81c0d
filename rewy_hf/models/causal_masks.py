"""The attention-mask mapping that says "causal, nothing else" to a transformers hybrid.

transformers' hybrid models (Qwen3.5, Qwen3-Next, Kimi-Linear, OLMo-hybrid)
build one mask per layer type before their layers run. Eagerly, with no
padding mask, that code finds the batch plainly causal and hands SDPA no
mask (``is_causal=True``: flash attention). Under ``torch.compile`` it cannot
read the position ids' values to rule out packed sequences, so it builds the
full [B, 1, T, T] causal mask and SDPA runs a masked kernel instead.

Their forward also takes that mapping ready-made (``attention_mask`` as a
dict from layer type to mask). A mapping with ``None`` for every layer type
is what the eager code computes for a batch of whole, unpadded rows; passed
in, it holds under compile too. The caller vouches that the batch is such
rows: with padding or packed sequences it would be wrong.
"""

from __future__ import annotations

import torch.nn as nn

# Model types whose forward takes the mapping and reads it per layer type (transformers 5.24; each is
# checked under compile by tests/models/test_causal_masks.py).
TAKES_MASK_MAPPING = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
                                "kimi_linear", "olmo_hybrid"})


def causal_only_masks(model: nn.Module) -> dict[str, None] | None:
    """``{layer type: None}`` for a transformers hybrid that takes a per-layer-type mask mapping
    (``TAKES_MASK_MAPPING``), or None for any other model (FLA's, rewy's GDN2), whose own mask
    handling then runs; a PEFT wrapper is looked through."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if not type(base).__module__.startswith("transformers.models.") or \
            getattr(config, "model_type", None) not in TAKES_MASK_MAPPING:
        return None
    return dict.fromkeys(config.layer_types)
