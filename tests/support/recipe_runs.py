"""What the recipe tests read back from a run, and the process state they reset between runs."""

from __future__ import annotations

import json
from pathlib import Path


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state, so the next recipe run in this process builds its own."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def metrics(out: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, one per logged step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out)]
