"""Context parallelism with the Triton backend (GPU only): two ranks share one GPU through a gloo
group, each holding half of a packed bf16 row; each rank's outputs and gradients must be as close
to the float32 torch backend on the whole row as one process on the whole row is. Whole tiny
transformers models (bf16), hybrids with their attention over the whole row included, must be as
close to the float32 model as each sequence run on its own in bf16 is, also compiled whole (inductor,
fullgraph). Their
MoE layers route every token to every expert: top-k routing turns a rounding difference into a
different expert for some tokens."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from support.cp_ranks import (compiled_cuda_rank_main, cuda_rank_main, free_port,
                              hf_hybrid_cuda_rank_main, hf_model_cuda_rank_main)

pytestmark = pytest.mark.gpu

CASES = [("gdn", [0, 700, 2048], 2, 4), ("kda", [0, 1000, 1000, 2048], 2, 2), ("gdn2", [0, 2048], 2, 2)]


def test_two_ranks_on_one_gpu():
    mp.spawn(cuda_rank_main, args=(2, free_port(), CASES), nprocs=2, join=True)


# Tiny transformers models whose layers are all delta-rule layers, their convolution's exchange included.
MODEL_CASES = [("qwen3_5", [0, 300, 512]), ("kimi_linear", [0, 254, 512])]


def test_transformers_models_two_ranks_on_one_gpu():
    mp.spawn(hf_model_cuda_rank_main, args=(2, free_port(), MODEL_CASES), nprocs=2, join=True)


# Hybrids: the attention layer's keys and values all-gathered over the gloo group (CUDA tensors).
HYBRID_CASES = [("qwen3_5", [0, 300, 512]), ("kimi_linear", [0, 254, 512])]


def test_transformers_hybrids_two_ranks_on_one_gpu():
    mp.spawn(hf_hybrid_cuda_rank_main, args=(2, free_port(), HYBRID_CASES), nprocs=2, join=True)


def test_compiled_hybrid_two_ranks_on_one_gpu():
    """The tiny Qwen3.5 hybrid compiled with fullgraph=True on the Triton backend, over five packings:
    its exchanges compile as custom ops into the one graph, and the packings cost at most two
    graphs (see check_compiled)."""
    rows = [[0, 512], [0, 300, 512], [0, 100, 256, 512], [0, 200, 512], [0, 40, 480, 512]]
    mp.spawn(compiled_cuda_rank_main, args=(2, free_port(), [("qwen3_5", rows)]), nprocs=2, join=True)
