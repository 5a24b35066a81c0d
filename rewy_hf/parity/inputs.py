"""What `rewy-hf parity` feeds the comparison: the model (optionally under LoRA) and its batches."""

from __future__ import annotations

import torch
import torch.nn as nn


def with_lora(model: nn.Module) -> nn.Module:
    """``model`` under a PEFT LoRA wrap of all its linear layers: only the adapters train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))


def token_batches(model: nn.Module, tokenizer, *, batch_size: int, seq_len: int, steps: int, seed: int,
                  text_file: str | None, name: str) -> list[torch.Tensor]:
    """``steps`` batches of token ids: random from ``seed``, or consecutive windows of ``text_file``
    through the model's tokenizer (repeating when the text runs out). ``name`` is the model's, for errors."""
    shape = (batch_size, seq_len)
    if text_file is None:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, model.config.vocab_size, shape, generator=gen) for _ in range(steps)]
    if tokenizer is None:
        raise ValueError(f"--text-file needs a tokenizer, and {name!r} has none; drop --text-file to use "
                         "random tokens")
    with open(text_file, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids.flatten()
    need = batch_size * seq_len
    if ids.numel() < need:
        raise ValueError(f"--text-file has {ids.numel()} tokens, fewer than one batch ({need}); use a longer file "
                         "or a smaller --batch-size/--seq-len")
    n = ids.numel() // need
    return [ids[(s % n) * need:(s % n + 1) * need].view(shape) for s in range(steps)]
