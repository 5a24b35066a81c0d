"""Context parallelism with the Triton backend (GPU only): two ranks share one GPU through a gloo
group, each holding half of a packed bf16 row; each rank's outputs and gradients must be as close
to the float32 torch backend on the whole row as one process on the whole row is."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from support.cp_ranks import cuda_rank_main, free_port

pytestmark = pytest.mark.gpu

CASES = [("gdn", [0, 700, 2048], 2, 4), ("kda", [0, 1000, 1000, 2048], 2, 2), ("gdn2", [0, 2048], 2, 2)]


def test_two_ranks_on_one_gpu():
    mp.spawn(cuda_rank_main, args=(2, free_port(), CASES), nprocs=2, join=True)
