"""Linear warmup then cosine decay, as a ``LambdaLR`` (its state_dict is all a resume needs)."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): ``(step+1)/warmup`` during warmup, then cosine
    from 1 down to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps, min_lr_ratio))
