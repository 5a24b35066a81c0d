"""``--resume``: which checkpoint a run continues from, the checks that it is sound and of this run,
and loading its training state.

Every refusal is a ``RecipeError`` naming the fix, raised before the data and the model are loaded
(except damage only loading can see, reported by ``load_training_state``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from . import checkpoint as ckpt
from . import output_dir
from .options import RecipeError


def resume_target(args, out_dir: Path, run_config: dict) -> tuple[Path, dict] | None:
    """(checkpoint, its trainer state) for --resume, after checking it is sound and of this run."""
    if args.resume is None:
        return None
    if args.resume == "latest":
        resume_from = latest_sound_checkpoint(out_dir)
    else:
        resume_from = Path(args.resume)
        if not (resume_from / ckpt.STATE_FILE).is_file():
            raise RecipeError(f"--resume {resume_from}: not a complete checkpoint (no {ckpt.STATE_FILE})")
        problem = ckpt.damage(resume_from)
        if problem is not None:
            raise RecipeError(f"--resume {resume_from}: {problem[0]} is damaged ({problem[1]}); "
                              + earlier_checkpoint_hint(resume_from))
    state = ckpt.read_state(resume_from)
    diff = ckpt.identity_diff(state["config"], run_config)
    if diff:
        raise RecipeError(f"--resume {resume_from}: it belongs to a run with other settings (checkpoint vs now): "
                          + ", ".join(diff) + "; resume with the checkpoint's settings, or start a new run in "
                          "another --output-dir")
    return resume_from, state


def latest_sound_checkpoint(out_dir: Path) -> Path:
    """The newest complete checkpoint that is not damaged; each damaged newer one is skipped with a warning."""
    found = ckpt.list_checkpoints(out_dir)
    if not found:
        if output_dir.previous_outputs(out_dir):
            # A fresh run is refused there too (output_dir.claim): name the one way forward.
            raise RecipeError(f"--resume: no complete checkpoint in {out_dir}: the run there stopped before its "
                              "first save, so there is nothing to resume; start it again with "
                              "--overwrite-output-dir in place of --resume, or pass another --output-dir")
        raise RecipeError(f"--resume: no complete checkpoint in {out_dir}; run without --resume to start fresh")
    damaged = []
    for _, path in reversed(found):
        problem = ckpt.damage(path)
        if problem is None:
            return path
        damaged.append(f"{problem[0]} ({problem[1]})")
        warnings.warn(f"--resume: {problem[0]} is damaged ({problem[1]}); skipping {path.name} for the "
                      "previous checkpoint", RuntimeWarning, stacklevel=2)
    raise RecipeError(f"--resume: every checkpoint in {out_dir} is damaged: " + "; ".join(damaged)
                      + "; start afresh with --overwrite-output-dir")


def earlier_checkpoint_hint(checkpoint: Path) -> str:
    previous = ckpt.previous_sound(checkpoint)
    if previous is None:
        return f"there is no earlier complete checkpoint in {checkpoint.parent}; start afresh"
    return f"resume from the previous complete checkpoint instead: --resume {previous}"


def finished(out_dir: Path, step: int, max_steps: int) -> bool:
    """Whether a run whose checkpoint is at ``step`` has nothing left to do: resuming would retrain nothing
    and only rewrite final/, the plot and the dispatch report."""
    return step >= max_steps and (out_dir / "final").is_dir()


def load_training_state(accelerator, checkpoint: Path) -> None:
    """accelerator.load_state, with a failure (damage the cheap check in ``ckpt.damage`` cannot see, such as
    flipped bytes) reported as the checkpoint's, not as a bare library error."""
    try:
        accelerator.load_state(str(checkpoint / ckpt.TRAINING_STATE_DIR))
    except Exception as exc:   # whatever the loaders raise on a bad file: torch, safetensors, pickle
        raise RecipeError(f"--resume {checkpoint}: cannot load {checkpoint / ckpt.TRAINING_STATE_DIR} "
                          f"({type(exc).__name__}: {exc}); " + earlier_checkpoint_hint(checkpoint)) from exc
