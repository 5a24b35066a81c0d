"""Atomic checkpoint directories.

A checkpoint is written under a hidden temporary name (``.checkpoint-N.partial``)
and renamed to ``checkpoint-N`` only after every file, ``trainer_state.json``
last, is on disk. Only names matching ``checkpoint-<digits>`` that contain
``trainer_state.json`` count as checkpoints, so a run killed mid-save leaves
nothing that looks complete.

Layout of ``checkpoint-N/``: the model as ``save_pretrained`` writes it (for
LoRA runs, the adapter), the tokenizer, ``training_state/`` (what
``accelerator.save_state`` writes: model, optimizer, scheduler, RNG states) and
``trainer_state.json`` (step, tokens seen, the run's configuration).

A run's identity is that configuration less the options that only steer resuming, logging, stopping and
checkpoint cadence; ``--resume`` refuses a checkpoint whose identity differs from the current run's.
``damage`` is a cheap soundness check of a checkpoint (headers and sizes, not the tensors) that
``--resume`` runs before loading one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
TRAINING_STATE_DIR = "training_state"
#: what a resume reads from trainer_state.json
STATE_KEYS = ("step", "tokens_seen", "config")
#: file name prefixes that accelerator.save_state's output must contain: (prefixes, what they hold)
_REQUIRED_STATE = ((("model", "pytorch_model"), "model weights"), (("optimizer",), "optimizer state"),
                   (("scheduler",), "LR scheduler state"))

#: configuration keys that are not part of a run's identity, because none of them changes what a step
#: computes: where the run writes and what it resumes from (output_dir, resume, overwrite_output_dir; a
#: checkpoint may be resumed into another directory), how far this invocation goes (stop_after), what is
#: printed (log_every, no_progress), and how often / how many checkpoints are kept (save_every,
#: keep_checkpoints). max_steps is part of the identity: the cosine schedule is a function of it, so another
#: value changes the learning rate of every step after the resumed one.
NOT_IDENTITY = frozenset({"output_dir", "resume", "overwrite_output_dir", "stop_after", "log_every",
                          "no_progress", "save_every", "keep_checkpoints"})


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


def identity_diff(recorded: dict, now: dict) -> list[str]:
    """``"key: checkpoint-value vs now-value"`` for every identity setting that differs."""
    def shown(config: dict, key: str) -> str:
        return repr(config[key]) if key in config else "(not recorded)"

    keys = sorted((set(recorded) | set(now)) - NOT_IDENTITY)
    return [f"{k}: {shown(recorded, k)} vs {shown(now, k)}" for k in keys
            if k not in recorded or k not in now or recorded[k] != now[k]]


def damage(checkpoint: str | os.PathLike) -> tuple[Path, str] | None:
    """(damaged file, what is wrong) for the first damaged file a resume reads from ``checkpoint``, or None.
    Cheap: it parses trainer_state.json and reads only the headers of the training-state files (safetensors
    header and size, torch zip directory), so truncation and garbled headers show, flipped tensor bytes not."""
    state_file = Path(checkpoint, STATE_FILE)
    why = _state_problem(state_file)
    if why:
        return state_file, why
    training_state = Path(checkpoint, TRAINING_STATE_DIR)
    if not training_state.is_dir():
        return training_state, "missing"
    files = sorted(training_state.iterdir())
    for prefixes, what in _REQUIRED_STATE:
        if not any(f.name.startswith(prefixes) for f in files):
            return training_state, f"holds no {what} ({' or '.join(x + '*' for x in prefixes)})"
    for f in files:
        if f.suffix == ".safetensors":
            why = _safetensors_problem(f)
        elif f.suffix in (".bin", ".pkl", ".pt"):
            why = _torch_file_problem(f)
        else:
            continue   # e.g. FSDP's sharded directories: loading them reports their own errors
        if why:
            return f, why
    return None


def previous_sound(checkpoint: Path) -> Path | None:
    """The newest undamaged checkpoint beside ``checkpoint`` and older than it."""
    m = CHECKPOINT_RE.match(checkpoint.name)
    older = [p for s, p in list_checkpoints(checkpoint.parent) if p != checkpoint and (not m or s < int(m.group(1)))]
    return next((p for p in reversed(older) if damage(p) is None), None)


def _state_problem(state_file: Path) -> str | None:
    try:
        state = json.loads(state_file.read_text())
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except ValueError as exc:   # JSONDecodeError and UnicodeDecodeError both are
        return f"not valid JSON ({exc})"
    if not isinstance(state, dict):
        return "not a JSON object"
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        return f"incomplete: no {', '.join(missing)}"
    if not isinstance(state["step"], int) or not isinstance(state["config"], dict):
        return "step is not a number or config not an object"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Checks the layout: 8-byte header length, JSON header, and the file ending where the last tensor does."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated: {size} bytes, not even the 8-byte header length"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"truncated: {size} bytes, shorter than its {n}-byte header"
        raw = f.read(n)
    try:
        header = json.loads(raw)
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        expected = 8 + n + max(ends, default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "corrupt: the safetensors header is not a valid tensor table"
    if size != expected:
        return f"truncated: {size} bytes, its header describes {expected}" if size < expected else \
            f"corrupt: {size} bytes, its header describes {expected}"
    return None


def _torch_file_problem(path: Path) -> str | None:
    """torch.save writes a zip archive whose directory is at the end, so a truncated file has none."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            entries = z.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"truncated or corrupt: {size} bytes, not a complete torch archive ({exc})"
    if any(e.header_offset + e.compress_size > size for e in entries):
        return f"truncated: {size} bytes, shorter than its archive directory says"
    return None


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
        # some filesystems cannot open or fsync a directory (network mounts, some container
        # overlays): the rename has happened, only its survival of a power loss is not assured
        pass


def prune(output_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (``keep <= 0``: keep all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
