"""One process of a multi-process recipe run on CPU (tests/training/test_context_parallel_recipe.py):
accelerate reads the rank from the environment, as under ``accelerate launch``, and talks gloo."""

from __future__ import annotations

import os


def rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="true")
    from rewy_hf.cpu_triton import enable_cpu_interpreter

    enable_cpu_interpreter()
    import torch

    torch.set_num_threads(1)
    from rewy_hf.training import recipe

    rc = recipe.main(argv)
    assert rc == 0, f"rank {rank}: the recipe exited with {rc}"
