"""One process of a multi-process recipe run on CPU (tests/training/test_context_parallel_recipe.py):
accelerate reads the rank from the environment and talks gloo. ``accelerate_cpu``: the environment
``accelerate launch --cpu`` adds (``ACCELERATE_USE_CPU``); without it, the environment of torchrun."""

from __future__ import annotations

import os


def rank_main(rank: int, world: int, port: int, argv: list[str], accelerate_cpu: bool = True) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if accelerate_cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"
    else:
        os.environ.pop("ACCELERATE_USE_CPU", None)
    from rewy_hf.cpu_triton import enable_cpu_interpreter

    enable_cpu_interpreter()
    import torch

    torch.set_num_threads(1)
    from rewy_hf.training import recipe

    rc = recipe.main(argv)
    assert rc == 0, f"rank {rank}: the recipe exited with {rc}"
