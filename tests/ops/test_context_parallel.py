"""Context parallelism on the torch backend: ranks of a gloo group, each holding a slice of one packed
row, give the outputs and input gradients of one process on the whole row (float64, 1e-10).

The cases put sequence boundaries inside a rank's slice and on a slice's edge, an empty sequence,
and one sequence through every rank (a middle rank whose first sequence is its last), for GDN (with
GVA and the in-kernel l2norm), KDA and GDN2.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from support.cp_ranks import (attention_dropout_rank_main, compiled_rank_main, free_port, hf_hybrid_rank_main,
                              hf_model_rank_main, model_rank_main, rank_main)

CASES = {
    2: [("gdn", [0, 37, 37, 170, 300], 1, 2, True), ("gdn", [0, 150, 300], 2, 2, False),
        ("kda", [0, 37, 37, 170, 300], 1, 2, False), ("gdn2", [0, 90, 300], 2, 2, True)],
    3: [("gdn", [0, 300], 1, 2, False), ("gdn", [0, 37, 37, 170, 300], 2, 2, True),
        ("kda", [0, 300], 2, 2, True), ("gdn2", [0, 37, 37, 170, 300], 2, 2, False)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_match_one_process(world):
    mp.spawn(rank_main, args=(world, free_port(), CASES[world]), nprocs=world, join=True)


MODEL_CASES = [("gated_deltanet", [0, 50, 128]), ("kda", [0, 128]), ("gdn2", [0, 20, 20, 128]),
               ("gated_deltanet", [0, 128], True)]


def test_patched_models_match_one_process():
    """rewy_hf.context_parallel on tiny patched models without short convolution: 2 ranks, float32
    (FLA's norms run in the Triton interpreter), logits and rank-summed parameter gradients; one case
    with gradient checkpointing, whose recomputed forwards must run context-parallel too."""
    mp.spawn(model_rank_main, args=(2, free_port(), MODEL_CASES), nprocs=2, join=True)


# Sequence boundaries: none (one sequence through both ranks), inside rank 0, two tokens before
# rank 1's slice (it borrows only those of its first sequence's inputs), on the slice edge.
HF_MODEL_CASES = [("qwen3_5", [0, 128]), ("qwen3_5", [0, 50, 126, 128]), ("kimi_linear", [0, 62, 128]),
                  ("kimi_linear", [0, 64, 100, 128]), ("qwen3_5", [0, 62, 128], True)]


def test_patched_transformers_models_match_sequences_run_alone():
    """rewy_hf.context_parallel on tiny transformers models whose layers are all delta-rule layers,
    short convolution included (rewy's exchange, kernels/context_parallel_conv.py): 2 ranks,
    float32, logits and rank-summed parameter gradients against each sequence run on its own; one
    case with gradient checkpointing (the recomputed forwards exchange again)."""
    mp.spawn(hf_model_rank_main, args=(2, free_port(), HF_MODEL_CASES), nprocs=2, join=True)


# Hybrids: sequence bounds as above; a sequence that starts on rank 0 and ends on rank 1 sends its
# keys and values across, one that starts on rank 1 needs none of rank 0's.
HF_HYBRID_CASES = [("qwen3_5", [0, 128]), ("qwen3_5", [0, 50, 126, 128]), ("kimi_linear", [0, 62, 128]),
                   ("qwen3_next", [0, 64, 100, 128]), ("olmo_hybrid", [0, 30, 128]), ("qwen3_5", [0, 62, 128], True)]


def test_patched_transformers_hybrids_match_sequences_run_alone():
    """rewy_hf.context_parallel on tiny transformers hybrids (delta-rule and full-attention layers):
    2 ranks, float32, the attention layers over an all-gather of keys and values, logits and
    rank-summed parameter gradients against each sequence run on its own; one case with gradient
    checkpointing."""
    mp.spawn(hf_hybrid_rank_main, args=(2, free_port(), HF_HYBRID_CASES), nprocs=2, join=True)


# Packings: the local sequence count of a rank goes 1, 2, 3 and back; a boundary on the slice edge.
COMPILED_ROWS = [[0, 128], [0, 50, 126, 128], [0, 20, 64, 100, 128], [0, 64, 128], [0, 30, 128]]


@pytest.mark.parametrize("kind", ["gdn2", "qwen3_5"])
def test_compiled_models_match_sequences_run_alone(kind):
    """A patched model compiled whole with fullgraph=True inside rewy_hf.context_parallel: the
    exchanges of the core, the short convolution and (the hybrid) attention compile into the graph;
    2 ranks, float32, five packings, at most two compiles."""
    mp.spawn(compiled_rank_main, args=(2, free_port(), [(kind, COMPILED_ROWS)]), nprocs=2, join=True)


def test_attention_dropout_backward_reruns_the_forwards_mask():
    """The attention's backward reruns SDPA: under dropout it must draw the forward's mask again."""
    mp.spawn(attention_dropout_rank_main, args=(1, free_port(), [()]), nprocs=1, join=True)
