"""How a call's tokens fall into chunks: per-row chunk counts, FLA's (sequence, chunk) table, packed bounds.

With packed sequences (``cu_seqlens``, B = 1) every sequence's chunks are
counted on their own, as FLA's stage functions count them, so a state tensor
has one row per chunk of every sequence and a chunk never spans two sequences.
"""

from __future__ import annotations

import weakref

import torch
import triton


def chunk_table(T: int, cu_seqlens, chunk_size: int, chunk_indices):
    """(chunks in all, FLA's (sequence, chunk) table or None); the table is built here
    when the caller has none."""
    if cu_seqlens is None:
        return triton.cdiv(T, chunk_size), chunk_indices
    if chunk_indices is None:
        from fla.ops.utils import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    return len(chunk_indices), chunk_indices


def chunk_count_and_offsets(T: int, cu_seqlens, chunk_size: int, chunk_indices):
    """(chunks per row of the state tensors, first chunk of each packed sequence or None)."""
    NT, _ = chunk_table(T, cu_seqlens, chunk_size, chunk_indices)
    if cu_seqlens is None:
        return NT, None
    from fla.ops.utils import prepare_chunk_offsets

    return NT, prepare_chunk_offsets(cu_seqlens, chunk_size)


_last_bounds: tuple = (None, ())


def host_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens on the host. Reading it is a device sync, so it is read once per tensor:
    a model's layers all pass the same one."""
    global _last_bounds
    ref, bounds = _last_bounds
    if ref is None or ref() is not cu_seqlens:
        bounds = tuple(cu_seqlens.tolist())
        _last_bounds = (weakref.ref(cu_seqlens), bounds)
    return bounds


_last_launches: tuple = (None, 0, ())


def chunk_launches(T: int, cu_seqlens, chunk_size: int) -> tuple[tuple[int, torch.Tensor | None, bool], ...]:
    """How a chunk kernel covers a call's chunks: (programs along the chunks, chunk order, every chunk full)
    per launch. A launch whose chunks are all full runs the kernel built without row masks (tiles.py).
    Dense rows: one launch over every chunk, in order. Packed sequences: only a sequence's last chunk
    can be short, so the full chunks go to one launch and the short ones to another; program i of a
    launch serves the chunk ``order[i]`` of FLA's (sequence, chunk) table. Read from the host bounds
    (one device sync per ``cu_seqlens`` tensor), kept for the tensor a model's layers share."""
    if cu_seqlens is None:
        return ((triton.cdiv(T, chunk_size), None, T % chunk_size == 0),)
    global _last_launches
    ref, size, launches = _last_launches
    if ref is None or ref() is not cu_seqlens or size != chunk_size:
        bounds = host_bounds(cu_seqlens)
        full, short, n = [], [], 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            chunks = triton.cdiv(end - start, chunk_size)
            whole = (end - start) // chunk_size
            full.extend(range(n, n + whole))
            short.extend(range(n + whole, n + chunks))
            n += chunks
        launches = tuple((len(order), torch.tensor(order, dtype=torch.int32, device=cu_seqlens.device), is_full)
                         for order, is_full in ((full, True), (short, False)) if order)
        _last_launches = (weakref.ref(cu_seqlens), chunk_size, launches)
    return launches
