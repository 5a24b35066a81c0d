"""The recipe under DDP with --compile on (the GPU default) trains as one process does: two gloo
processes on CPU, each compiling its DDP-wrapped model, log the losses of one eager process on the
same global batches. (Accelerate wraps FSDP only on accelerator devices; test_fsdp_compile.py builds
the FSDP wrapping of the recipe's config with torch directly.)"""

from __future__ import annotations

import json

import torch.multiprocessing as mp

from support.cp_ranks import free_port
from support.recipe_ranks import rank_main
from support.recipe_runs import losses

COMMON = ["--seq-len", "80", "--lr", "3e-3", "--warmup-steps", "1", "--max-steps", "2", "--no-progress"]


def test_compiled_ddp_logs_the_one_process_losses(tmp_path):
    from rewy_hf.training import recipe

    one, two = tmp_path / "one", tmp_path / "ddp"
    # One process takes both ranks' batches at once: 2 x 2 rows per step.
    assert recipe.main([*COMMON, "--batch-size", "4", "--compile", "off", "--output-dir", str(one)]) == 0
    mp.spawn(rank_main, args=(2, free_port(), [*COMMON, "--batch-size", "2", "--compile", "on", "--output-dir",
                                               str(two)]), nprocs=2, join=True)
    config = json.loads((two / "run_config.json").read_text())
    assert config["compile"] == "on" and config["world_size"] == 2
    ref, got = losses(one), losses(two)
    assert len(ref) == len(got) == 2
    for step, (a, b) in enumerate(zip(got, ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: DDP compiled {a:.7f}, one eager process {b:.7f}"
