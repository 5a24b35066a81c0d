"""--context-parallel on CPU: two gloo processes each train half of every packed row of the
tiny-fla-gdn2 preset (no short convolution), of gdn2-tiny (FLA's layers with their short
convolution, whose exchange runs as rewy's on the CPU) started as torchrun starts them, and of the
tiny-qwen3.5 hybrid, and log the losses one process logs on the whole rows; bad settings, and one
process (with the launcher that works on the CPU named), are refused first."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch.multiprocessing as mp

from support.cp_ranks import free_port
from support.recipe_ranks import rank_main
from support.recipe_runs import losses

COMMON = ["--model", "tiny-fla-gdn2", "--seq-len", "96", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1",
          "--max-steps", "3", "--no-progress", "--compile", "off"]


@pytest.mark.parametrize("model,sizes,accelerate_cpu", [
    ("tiny-fla-gdn2", [], True),
    ("gdn2-tiny", ["--seq-len", "64"], False),                 # as torchrun starts the processes
    ("tiny-qwen3.5", ["--batch-size", "3", "--seq-len", "64"], True)])
def test_two_processes_log_the_one_process_losses(tmp_path, model, sizes, accelerate_cpu):
    """tiny-qwen3.5 is a hybrid: its attention layer attends over the all-gathered row, its delta-rule
    layer's short convolution takes rewy's exchange; 3 windows of 64 put a window across the ranks'
    boundary, so rank 1's positions and attention reach back into rank 0's tokens."""
    from rewy_hf.training import recipe

    argv = [*COMMON, "--model", model, *sizes]
    one, two = tmp_path / "one", tmp_path / "two"
    assert recipe.main([*argv, "--output-dir", str(one)]) == 0
    mp.spawn(rank_main, args=(2, free_port(), [*argv, "--context-parallel", "--output-dir", str(two)], accelerate_cpu),
             nprocs=2, join=True)
    ref, split = losses(one), losses(two)
    assert len(ref) == len(split) == 3
    for step, (a, b) in enumerate(zip(split, ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: context parallel {a:.7f}, one process {b:.7f}"


def test_one_process_is_refused(tmp_path, capsys):
    from rewy_hf.training import recipe

    assert recipe.main([*COMMON, "--context-parallel", "--output-dir", str(tmp_path)]) == 2
    # on the CPU, where `accelerate launch --cpu` starts one process whatever --num_processes says
    assert "run `torchrun --nproc_per_node 2 recipes/finetune_gdn2.py" in capsys.readouterr().err


@pytest.mark.parametrize("settings,world,fragment", [
    (dict(core="original"), 2, "drop --core original"),
    (dict(batch_size=1, seq_len=95), 2, "95 tokens do not split evenly over 2 processes"),
    (dict(batch_size=3, seq_len=65), 4, "195 tokens do not split evenly over 4 processes"),
])
def test_settings_are_checked(settings, world, fragment):
    from rewy_hf.training.context_split import check
    from rewy_hf.training.options import RecipeError

    args = SimpleNamespace(**{"context_parallel": True, "core": "rewy", "batch_size": 2, "seq_len": 96, **settings})
    with pytest.raises(RecipeError, match=re.escape(fragment)):
        check(args, world)


def test_one_process_on_a_gpu_is_told_to_launch_more():
    from rewy_hf.training.context_split import check
    from rewy_hf.training.options import RecipeError

    args = SimpleNamespace(context_parallel=True, core="rewy", batch_size=2, seq_len=96)
    with pytest.raises(RecipeError, match=re.escape("e.g. `accelerate launch --num_processes 2")):
        check(args, 1, on_cpu=False)


def test_compiled_processes_log_the_one_process_losses(tmp_path):
    """--compile on with --context-parallel: the tiny-qwen3.5 hybrid compiled in each of two processes
    (its delta-rule core, convolution and attention exchanges are custom ops inside the one graph)
    logs the losses of one eager process on the whole rows."""
    from rewy_hf.training import recipe

    argv = [*COMMON, "--model", "tiny-qwen3.5", "--batch-size", "3", "--seq-len", "64"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert recipe.main([*argv, "--output-dir", str(one)]) == 0
    mp.spawn(rank_main, args=(2, free_port(), [*argv, "--compile", "on", "--context-parallel", "--output-dir",
                                                str(two)]), nprocs=2, join=True)
    ref, split = losses(one), losses(two)
    assert len(ref) == len(split) == 3
    for step, (a, b) in enumerate(zip(split, ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: compiled context parallel {a:.7f}, one process {b:.7f}"
