"""Claiming ``--output-dir`` for one run: writability, a lock file, and the previous run's files.

The lock is ``<output-dir>/.lock``, created with ``O_CREAT | O_EXCL`` (so only one run can create it) and
holding ``{"pid": ..., "host": ...}``. A lock whose process no longer runs on this host was left by a killed
run and is taken over with a warning; any other lock refuses the run. Only the main process of a
multi-process run takes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path

from .checkpoint import list_checkpoints
from .options import RecipeError

LOCK_NAME = ".lock"

#: what a run writes into --output-dir besides checkpoints; --overwrite-output-dir removes these, the
#: checkpoints and nothing else, so other files a user keeps there survive
RUN_FILES = ("metrics.jsonl", "run_config.json", "loss_curve.png", "dispatch_report.json", "final",
             "final-adapter", ".final.partial", ".final-adapter.partial")
#: checkpoint-N, and the .checkpoint-N.partial / .checkpoint-N.old a save in progress leaves
_CHECKPOINT_NAMES = re.compile(r"^(checkpoint-\d+|\.checkpoint-\d+\.(partial|old))$")


def claim(out_dir: Path, *, fresh: bool, overwrite: bool) -> Path:
    """Create ``out_dir``, take its lock and return the lock's path. A fresh run (no --resume) is refused
    where an earlier run's files are, unless ``overwrite`` (the caller clears them with ``clear_previous``)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecipeError(f"--output-dir {out_dir}: cannot create it ({exc.strerror or exc}); pass a directory "
                          "this user can write") from None
    lock = take_lock(out_dir)
    previous = previous_outputs(out_dir)
    if fresh and previous and not overwrite:
        release_lock(lock)
        names = ", ".join(p.name for p in previous[:4]) + (", ..." if len(previous) > 4 else "")
        if not list_checkpoints(out_dir):
            raise RecipeError(f"--output-dir {out_dir} holds a run that stopped before its first checkpoint "
                              f"({names}), so --resume has nothing to continue: start it again with "
                              "--overwrite-output-dir (deletes those files), or pass another --output-dir")
        raise RecipeError(f"--output-dir {out_dir} already holds a run ({names}); continue it with --resume, "
                          "replace it with --overwrite-output-dir, or pass another --output-dir")
    return lock


def previous_outputs(out_dir: Path) -> list[Path]:
    """The files and directories of an earlier run in ``out_dir`` (checkpoints, metrics, final/, ...)."""
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if p.name in RUN_FILES or _CHECKPOINT_NAMES.match(p.name))


def clear_previous(out_dir: Path) -> None:
    for path in previous_outputs(out_dir):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


# --- the lock ---------------------------------------------------------------------------------------

def take_lock(out_dir: Path) -> Path:
    lock = out_dir / LOCK_NAME
    # A second attempt follows the takeover of a stale lock; a third would mean another run is taking
    # it over at the same moment, which the refusal below reports.
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _take_over_if_stale(lock)
            continue
        except OSError as exc:
            raise RecipeError(f"--output-dir {out_dir} is not writable (creating {lock}: {exc.strerror or exc}); "
                              "pass a directory this user can write") from None
        with os.fdopen(fd, "w") as f:
            json.dump(_me(), f)
        return lock
    raise RecipeError(f"--output-dir {out_dir}: another run took {lock} at the same moment; pass another "
                      "--output-dir or wait for that run to finish")


def release_lock(lock: Path) -> None:
    """Remove the lock if it is still this process's (never another run's that took over a stale one)."""
    if _holder(lock) == _me():
        lock.unlink(missing_ok=True)


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _holder(lock: Path) -> dict | None:
    """The lock's {"pid", "host"}, or None if it is gone, empty or garbled."""
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(holder, dict) and isinstance(holder.get("pid"), int) and holder["pid"] > 0 \
        and isinstance(holder.get("host"), str)
    return {"pid": holder["pid"], "host": holder["host"]} if ok else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)   # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by another user
        return True
    return True


def _take_over_if_stale(lock: Path) -> None:
    """Return once a stale lock is out of the way (or gone); RecipeError while another run holds it."""
    if not lock.exists():
        return   # its run just finished; try again
    holder = _holder(lock)
    where = lock.parent
    if holder is None:
        # Also what a run that is creating the lock this instant looks like, so it is not taken over.
        raise RecipeError(f"--output-dir {where} is locked by {lock}, which names no process (a run starting "
                          f"up, or a damaged lock); delete {lock} if no run uses {where}")
    pid, host = holder["pid"], holder["host"]
    if host != socket.gethostname():
        raise RecipeError(f"--output-dir {where} is in use by pid {pid} on host {host} (lock {lock}); wait for "
                          f"that run, or delete {lock} if it is no longer running")
    if _pid_alive(pid):
        raise RecipeError(f"--output-dir {where} is in use by another run: pid {pid} holds {lock}; wait for it "
                          "to finish or pass another --output-dir")
    # Move it aside before deleting, so two runs taking over at once cannot delete each other's new lock.
    aside = lock.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return   # another run took it over first; the retry meets that run's lock
    if _holder(aside) != holder:   # what was moved is a lock a faster run had just created: give it back
        os.replace(aside, lock)
        raise RecipeError(f"--output-dir {where} is in use by another run (lock {lock}); wait for it to finish "
                          "or pass another --output-dir")
    aside.unlink()
    warnings.warn(f"--output-dir {where}: took over the lock {lock} of pid {pid}, which is no longer running "
                  "(a run that was killed)", RuntimeWarning, stacklevel=2)
