"""``metrics.jsonl``: one JSON object per optimizer step (its loss, learning rate, gradient norm,
tokens per second, step time, ...), written as the run goes and read back for the plot and the
end summary (``loss_plot``, ``summary``)."""

from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsWriter:
    """Appends records to ``path``. With ``resume_step``, first drops records of steps after it
    (written by a run that died before its next checkpoint), so the file stays one clean sequence."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:   # a torn last line from a killed run
            break
    return out
