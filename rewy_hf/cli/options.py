"""Options several commands share, so each word means one thing everywhere.

``--backend`` is rewy's backend (``auto|torch|triton``), ``--core`` picks
rewy's delta-rule core or the model's own (``rewy|original``), ``--dtype`` takes
torch's dtype names, and ``--json PATH`` writes the command's JSON report
there; ``--json -`` writes it to stdout, and the human-readable output then
goes to stderr so that stdout holds nothing but the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from ..command_line import CORES, HelpFormatter  # noqa: F401  (the commands take them from here)
from ..validation import BACKENDS

STDOUT = "-"
DTYPES = ("bfloat16", "float16", "float32", "float64")
BACKEND_HELP = "rewy's backend: auto (triton on CUDA where rewy has Triton kernels, else torch), torch, or triton"


def at_least(minimum: int):
    """argparse type: an integer no smaller than ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {minimum}")
        return value
    return parse


def tolerance(text: str) -> float:
    """argparse type: a finite number, 0 or more (0 asks for an exact match)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text}: a tolerance is a finite number, 0 or more")
    return value


def add_backend(parser, default: str = "auto") -> None:
    parser.add_argument("--backend", choices=BACKENDS, default=default, help=BACKEND_HELP)


def add_dtype(parser, choices: tuple[str, ...], default: str | None, help: str) -> None:
    parser.add_argument("--dtype", choices=choices, default=default, help=help)


def add_json(parser, what: str, without: str = "") -> None:
    """``--json PATH``; ``without`` says what the command writes when it is left out."""
    parser.add_argument("--json", default=None, metavar="PATH",
                        help=f"write {what} as JSON to PATH ('-': to stdout, the other output then goes to stderr)"
                             + (f"; without it {without}" if without else ""))


DEVICES = ("cuda", "cpu")


def add_device(parser, help: str) -> None:
    """``--device cuda|cpu``, default None: ``chosen_device`` then picks cuda where torch sees it."""
    parser.add_argument("--device", choices=DEVICES, default=None, help=help)


NO_CUDA = "--device cuda, but torch sees no CUDA device; use --device cpu"


def chosen_device(requested: str | None) -> str | None:
    """``--device`` as given, else cuda where torch sees a CUDA device, else cpu; None where cuda
    is asked for and torch sees none (the caller then reports ``NO_CUDA``)."""
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    return None if device == "cuda" and not torch.cuda.is_available() else device


def write_json(path: str, data: dict, stdout=None) -> None:
    """``data`` as JSON to ``path``, or to ``stdout`` (default: the current sys.stdout) for '-'."""
    text = json.dumps(data, indent=2, default=str) + "\n"
    if path == STDOUT:
        stream = stdout or sys.stdout
        stream.write(text)
        stream.flush()
        return
    # Written beside the target and moved over it: a run killed while saving (the packed bench saves
    # after every step) leaves the previous complete file, never a truncated one.
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class JsonReport:
    """Where a command's ``--json`` report goes.

    ``save(data)`` while the command runs keeps a file up to date (a run killed
    half way still leaves what it had); stdout can take one document only, so
    for '-' only ``finish(data)`` writes. Inside ``human_output()`` everything
    printed goes to stderr when the report goes to stdout.
    """

    def __init__(self, path: str | None):
        self.path = path
        self.stdout = sys.stdout

    @property
    def to_stdout(self) -> bool:
        return self.path == STDOUT

    def save(self, data: dict) -> None:
        if self.path is not None and not self.to_stdout:
            write_json(self.path, data)

    def finish(self, data: dict) -> None:
        if self.path is not None:
            write_json(self.path, data, stdout=self.stdout)

    def human_output(self) -> contextlib.AbstractContextManager:
        return contextlib.redirect_stdout(sys.stderr) if self.to_stdout else contextlib.nullcontext()
