"""Atomic checkpoint directories.

A checkpoint is written under a hidden temporary name (``.checkpoint-N.partial``)
and renamed to ``checkpoint-N`` only after every file, ``trainer_state.json``
last, is on disk. Only names matching ``checkpoint-<digits>`` that contain
``trainer_state.json`` count as checkpoints, so a run killed mid-save leaves
nothing that looks complete.

Layout of ``checkpoint-N/``: the model as ``save_pretrained`` writes it (for
LoRA runs, the adapter), the tokenizer, ``training_state/`` (what
``accelerator.save_state`` writes: model, optimizer, scheduler, RNG states) and
``trainer_state.json`` (step, tokens seen, the settings that fix the data order).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
TRAINING_STATE_DIR = "training_state"


def partial_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir, f".checkpoint-{step}.partial")


def final_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir, f"checkpoint-{step}")


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    out = []
    root = Path(output_dir)
    if not root.is_dir():
        return out
    for child in root.iterdir():
        m = CHECKPOINT_RE.match(child.name)
        if m and (child / STATE_FILE).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def write_state(directory: Path, state: dict) -> None:
    """Write ``trainer_state.json`` (fsynced): the marker that the directory is complete."""
    tmp = directory / (STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / STATE_FILE)


def read_state(checkpoint: str | os.PathLike) -> dict:
    return json.loads(Path(checkpoint, STATE_FILE).read_text())


def commit(partial: Path, final: Path) -> None:
    """Rename a finished partial checkpoint to its final name (replacing an older one of that name)."""
    if final.exists():
        trash = final.with_name(f".{final.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        os.rename(partial, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(partial, final)
    try:  # make the rename itself durable
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def prune(output_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (``keep <= 0``: keep all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
