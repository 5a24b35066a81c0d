"""How much of the GPU a sequential state walk fills, the measure the state checkpoints go by.

FLA's state recurrences (and rewy's reverse walk) run one program per
(sequence, value head, block of value columns), each walking its sequence's
chunks in order: N x HV x V / BV programs is all the parallelism they have.
Where that fills less than half the SMs, the state checkpoints cut the
sequences into segments for the forward states' rebuild (docs/architecture.md).
"""

from __future__ import annotations

import torch
import triton

# On a tensor off the GPU (the interpreter tests) launch decisions follow an H200's 132 SMs.
DEFAULT_SM_COUNT = 132


def sm_count(t: torch.Tensor) -> int:
    """The SMs of ``t``'s GPU."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else DEFAULT_SM_COUNT


def fills_half(sequences: int, value_heads: int, V: int, sms: int) -> bool:
    """Whether N x HV x V / 64 programs (FLA's widest value block) fill half of ``sms`` SMs or more."""
    return 2 * sequences * value_heads * triton.cdiv(V, 64) >= sms


def fewest_filling_half(value_heads: int, V: int, sms: int) -> int:
    """The fewest sequences for which ``fills_half`` holds."""
    return -(-sms // (2 * value_heads * triton.cdiv(V, 64)))


def launch_fills_half(v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> bool:
    """``fills_half`` for v [B, T, HV, V] on its GPU, N counted from ``cu_seqlens`` when packed.
    Decided from shapes alone: reading the packed lengths would cost a device sync."""
    B, _, HV, V = v.shape
    sequences = B if cu_seqlens is None else len(cu_seqlens) - 1
    return fills_half(sequences, HV, V, sm_count(v))
