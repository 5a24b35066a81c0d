"""chunks.chunk_launches: which chunks each launch of a chunk kernel serves, and whether all of them are
full (so the launch can run the kernel built without row masks)."""

from __future__ import annotations

import pytest
import torch

from rewy_hf.kernels.triton_backend.chunks import chunk_launches, chunk_table


@pytest.mark.parametrize("T,expected", [(128, ((2, None, True),)), (130, ((3, None, False),))])
def test_dense_rows_take_one_launch_in_order(T, expected):
    assert chunk_launches(T, None, 64) == expected


@pytest.mark.parametrize("lengths", [[70, 130, 20, 0, 64], [64, 128, 192], [5, 1, 63]])
def test_packed_chunks_split_into_full_and_short(lengths):
    """Every chunk of FLA's (sequence, chunk) table is served exactly once; a launch said to be full has
    only chunks with 64 rows, the other only chunks with fewer; no launch is empty."""
    cu = torch.tensor([0] + lengths).cumsum(0)
    NT, table = chunk_table(int(cu[-1]), cu, 64, None)
    launches = chunk_launches(int(cu[-1]), cu, 64)
    served = [i for _, order, _ in launches for i in order.tolist()]
    assert sorted(served) == list(range(NT))
    for chunks, order, full in launches:
        assert chunks == len(order) > 0 and order.dtype == torch.int32
        for i in order.tolist():
            n, t = table[i].tolist()
            rows = min(64, lengths[n] - 64 * t)
            assert 0 < rows and (rows == 64) == full
    fulls = [full for *_, full in launches]
    assert len(set(fulls)) == len(fulls) and fulls == sorted(fulls, reverse=True)   # at most one of each, full first


def test_a_new_packing_is_read_again():
    """The table is kept for the cu_seqlens tensor last seen; another tensor is read afresh."""
    a = torch.tensor([0, 64, 100])
    b = torch.tensor([0, 36, 72])
    assert [(c, f) for c, _, f in chunk_launches(100, a, 64)] == [(1, True), (1, False)]
    assert [(c, f) for c, _, f in chunk_launches(72, b, 64)] == [(2, False)]
    assert [(c, f) for c, _, f in chunk_launches(100, a, 32)] == [(3, True), (1, False)]
