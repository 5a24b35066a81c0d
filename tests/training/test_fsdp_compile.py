"""A patched model under FSDP (the recipe's fsdp.yaml settings) and torch.compile trains as one process
does: two gloo processes on CPU, each compiling its FSDP-wrapped share, log the one eager process's
losses on the same global batch. Accelerate wraps FSDP only on accelerator devices, so this builds the
FSDP wrapping the recipe's config asks Accelerate for directly with torch."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from support.cp_ranks import free_port
from support.fsdp_ranks import STEPS, one_process_losses, rank_main


def _run_against(main, ref: list[float], what: str, tmp_path) -> dict:
    """Two processes of ``main``; their logged losses against ``ref`` step by step, every delta-rule
    backward on rewy; rank 0's record."""
    out = tmp_path / "rank0.pt"
    mp.spawn(main, args=(2, free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    assert len(ref) == len(got["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {what} {a:.7f}, one eager process {b:.7f}"
    assert ref[1] < ref[0], "the reference trained"
    ops = got["report"]["ops"]["gated_delta_rule"]
    assert ops["optimized_backward_calls"] == STEPS and ops["fallback_calls"] == 0
    return got


def test_compiled_fsdp_logs_the_one_process_losses(tmp_path):
    got = _run_against(rank_main, one_process_losses(), "FSDP compiled", tmp_path)
    assert got["graphs"] >= 1, "the FSDP-wrapped model was compiled"


def test_compiled_fsdp_context_parallel_logs_the_one_process_losses(tmp_path):
    """FSDP, torch.compile and context parallelism together, as `accelerate launch --config_file
    recipes/configs/fsdp.yaml ... --context-parallel` runs them: the tiny Qwen3.5 hybrid (delta-rule,
    attention and delta-rule layers) on its slices of one packed row logs the one eager process's
    losses on the windows as a batch."""
    from support.fsdp_ranks import cp_rank_main, one_process_window_losses

    _run_against(cp_rank_main, one_process_window_losses(), "FSDP compiled context parallel", tmp_path)
