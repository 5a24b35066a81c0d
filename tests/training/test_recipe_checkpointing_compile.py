"""--gradient-checkpointing with --compile on: the recipe lets dynamo compile the checkpointed
patched layers (rather than run them eagerly at a graph break, docs/usage.md) for the run only,
and trains as the eager run does. It switches checkpointing on through transformers' current API
(no deprecation warning from transformers)."""

from __future__ import annotations

import warnings

import torch
from torch._dynamo.utils import counters

from support.recipe_runs import losses

COMMON = ["--model", "tiny-qwen3.5", "--seq-len", "64", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1",
          "--max-steps", "2", "--no-progress", "--gradient-checkpointing"]


def test_checkpointed_layers_compile_and_train_as_eagerly(tmp_path):
    from rewy_hf.training import recipe

    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert recipe.main([*COMMON, "--compile", "off", "--output-dir", str(eager)]) == 0
    deprecated = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "transformers" in w.filename
                  and issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecated, deprecated
    counters.clear()
    assert recipe.main([*COMMON, "--compile", "on", "--output-dir", str(compiled)]) == 0
    breaks = dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1, "the model was compiled"
    assert not [reason for reason in breaks if "side effect" in reason], breaks
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False, "set for the run only"
    ref, got = losses(eager), losses(compiled)
    assert len(ref) == len(got) == 2
    for step, (a, b) in enumerate(zip(got, ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: compiled {a:.7f}, eager {b:.7f}"
