"""Tiny models shared by the `rewy-hf run` test scripts (imported from the
script folder, which `rewy-hf run` puts first on sys.path)."""

import torch


def tiny_qwen35(seed: int = 0):
    """A 2-layer Qwen3.5 text model: one Gated DeltaNet layer, one full-attention layer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    )
    return Qwen3_5ForCausalLM(config)


def tiny_llama(seed: int = 0):
    """A model without delta-rule layers: safe to run unpatched on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config)
