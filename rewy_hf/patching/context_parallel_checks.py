"""Whether the ranks' contexts describe one packed row, checked on every rank before any exchange.

FLA's context holds only one rank's view of the row: its local sequence bounds, and how many ranks
its first and last sequences span. ``build_cp_context`` makes such a view from any bounds, sorted or
not; nothing ties the ranks' views to each other, nor to the row's bounds that ``context_parallel``
takes for attention layers. Views that contradict each other do not fail: every rank runs, and the
exchanged states, convolution inputs and keys land on the wrong sequences. So each rank checks its
own view (local bounds from 0 upwards, a chain position that agrees with itself, and, given the
row's bounds, the view those bounds give it), then every rank's view is gathered once and
neighbouring ranks are checked against each other (a sequence that runs on past a rank's slice
continues the next one, which counts it). The verdicts travel with the views, so a refusal on one
rank is a refusal on all: no rank is left waiting in an exchange that the others never join.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError
from ..kernels.context_parallel_call import CPCall, context_fault, gather_ranks

_FIX = ("build every rank's context from the same sorted bounds of the whole row (0, ..., the row's length, "
        "never decreasing), e.g. with rewy_hf.build_cp_context(cu_seqlens, group)")

# A rank's record, by position: its verdict, then its view of the row, then a digest of the row's
# bounds it was given (if any).
_FAULT, _PART, _FIRST, _LAST, _PRE, _POST, _CONV, _SEQS, _LAST_START, _HAS_ROW, _ROW_LEN, _ROW_HASH = range(12)


def view_of(row: list[int], world: int, rank: int) -> tuple[list[int], list[int]]:
    """(local bounds, [is_first, is_last, pre_ranks, post_ranks, pre_conv_tokens]) of ``rank``'s slice
    of the sorted ``row`` split over ``world`` ranks, as FLA's ``build_cp_context`` makes them."""
    part = row[-1] // world
    lo, hi = rank * part, (rank + 1) * part
    local = [0] + sorted({b - lo for b in row if lo < b < hi}) + [part]
    first_start = max(b for b in row if b <= lo)
    last_end = min(b for b in row if b >= hi)
    pre, post = rank - first_start // part, (last_end - 1) // part - rank
    return local, [int(pre == 0), int(post == 0), pre, post, lo - first_start]


def row_fault(row: list[int], world: int) -> str | None:
    """What makes ``row`` (the row's bounds) unusable for a split over ``world`` ranks, or None."""
    if len(row) < 2 or row[0] != 0 or any(b < a for a, b in zip(row, row[1:])):
        return f"cu_seqlens={_short(row)} must start at 0 and never decrease (the row's sequence bounds, in order)"
    if row[-1] < world or row[-1] % world:
        return (f"the row's {row[-1]} tokens do not split evenly over {world} ranks; pad the row to a multiple of "
                f"{world}")
    return None


def local_fault(call: CPCall, row: list[int] | None, world: int, rank: int) -> str | None:
    """What this rank alone can see is wrong with its context, and with the row's bounds ``row``."""
    if row is not None and (fault := row_fault(row, world)) is not None:
        return fault
    if (fault := context_fault(call.bounds, call.meta)) is not None:
        return f"this rank's cp_context cannot come from one packed row: {fault}; {_FIX}"
    if row is None:
        return None
    local, meta = view_of(row, world, rank)
    held, held_meta = call.bounds.tolist(), call.meta.tolist()
    if local != held:
        differ = f"give rank {rank} of {world} the local bounds {_short(local)}, while cp_context holds {_short(held)}"
    elif meta != held_meta:
        differ = (f"place rank {rank} of {world} in the chain of ranks as {_describe(meta)}, while cp_context says "
                  f"{_describe(held_meta)}")
    else:
        return None
    return (f"cu_seqlens={_short(row)} are not the bounds cp_context was built from: they {differ}; pass "
            "context_parallel the cu_seqlens the context was built from (the whole row's, the same on every rank)")


def chain_fault(records: torch.Tensor) -> str | None:
    """What contradicts between the ranks' views (``records``: [world, 12], every rank's), or None."""
    r = records.tolist()
    world = len(r)
    if len({x[_PART] for x in r}) > 1:
        return (f"the ranks' contexts give them slices of different lengths ({[x[_PART] for x in r]} tokens, by "
                "rank): they were built from different rows")
    given = {(x[_ROW_LEN], x[_ROW_HASH]) for x in r if x[_HAS_ROW]}
    if len(given) > 1:
        return "the ranks passed context_parallel different cu_seqlens"
    if not r[0][_FIRST] or not r[-1][_LAST]:
        end = 0 if not r[0][_FIRST] else world - 1
        return f"rank {end}'s context says a sequence runs past the row's {'start' if end == 0 else 'end'}"
    for i in range(world - 1):
        a, b = r[i], r[i + 1]
        goes_on = not a[_LAST]
        if goes_on == bool(b[_FIRST]):
            return (f"rank {i}'s context says its last sequence {'runs on into' if goes_on else 'ends before'} "
                    f"rank {i + 1}'s slice, but rank {i + 1}'s says its first sequence "
                    f"{'starts there' if b[_FIRST] else 'began on an earlier rank'}")
        if goes_on:
            one, next_one = a[_SEQS] == 1, b[_SEQS] == 1
            if (b[_PRE] != (a[_PRE] if one else 0) + 1 or a[_POST] != (b[_POST] if next_one else 0) + 1
                    or b[_CONV] != (a[_CONV] if one else 0) + a[_PART] - a[_LAST_START]):
                return (f"ranks {i} and {i + 1} disagree on where the sequence they share starts or ends (rank {i}: "
                        f"{_describe(a[_FIRST:_SEQS])}; rank {i + 1}: {_describe(b[_FIRST:_SEQS])})")
    return None


def check_row(call: CPCall, group, row_bounds: torch.Tensor | None) -> None:
    """Refuse, on every rank of ``group``, a context or row bounds that do not describe one packed row
    (the module docstring); one all-gather of a few integers per rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    row = None if row_bounds is None else row_bounds.detach().reshape(-1).cpu().tolist()
    fault = local_fault(call, row, world, rank)
    if world == 1:
        if fault is not None:
            raise UnsupportedConfigError(f"context_parallel: {fault}.")
        return
    mine = record(fault is not None, call.bounds.reshape(-1).tolist(), call.meta.tolist(), row)
    records = gather_ranks(torch.tensor(mine, dtype=torch.int64, device=_exchange_device(call, group)), group).cpu()
    if fault is not None:
        raise UnsupportedConfigError(f"context_parallel: {fault}.")
    refused = [i for i, x in enumerate(records[:, _FAULT].tolist()) if x]
    if refused:
        raise UnsupportedConfigError(
            f"context_parallel: rank(s) {refused} refused the row's context (their error says why); every rank "
            "stops here, so that none waits for the others in an exchange.")
    if (fault := chain_fault(records)) is not None:
        raise UnsupportedConfigError(f"context_parallel: the ranks' contexts do not describe one packed row: "
                                     f"{fault}; {_FIX}.")


def record(refused: bool, local: list[int], meta: list[int], row: list[int] | None) -> list[int]:
    """What a rank sends the others: its verdict, its view (``local`` bounds, ``meta`` as
    ``CPCall.meta``) and a digest of the row's bounds it was given."""
    ends = local[-2:] if len(local) >= 2 else [0, 0]
    return [int(refused), ends[1], *meta, max(len(local) - 1, 0), ends[0], int(row is not None),
            0 if row is None else len(row), 0 if row is None else _digest(row)]


def _exchange_device(call: CPCall, group) -> torch.device:
    """Where the records travel: the context's device, or the current GPU for NCCL with host bounds."""
    device = call.cu_seqlens.device
    if device.type == "cpu" and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _digest(row: list[int]) -> int:
    h = 0
    for b in row:
        h = (h * 1_000_003 + b + 1) % (2 ** 61 - 1)
    return h


def _describe(meta: list[int]) -> str:
    is_first, is_last, pre, post, conv = meta
    return (f"is_first_rank={bool(is_first)}, is_last_rank={bool(is_last)}, pre_num_ranks={pre}, "
            f"post_num_ranks={post}, pre_num_conv_tokens={conv}")


def _short(values: list) -> list:
    return values if len(values) < 12 else values[:12] + ["..."]
