"""The numbers a recipe run ends with: its final and best loss (with their steps), its wall time, the
tokens per second of its training steps, and its peak memory.

The losses are those of ``metrics.jsonl``, so a resumed run's include the steps taken before the
resume; the times and the memory are this process's: wall time from the start of ``train`` to the
summary, tokens per second as the training tokens of the steps it ran over the time spent in those
steps (not in loading, saving or anything else between them), and the peak memory as
``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak resident set size
(``resource.getrusage``). The recipe prints ``lines()`` with the paths of its outputs and stores
``to_dict()`` in ``run_config.json`` under "summary".
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch

RSS = "peak RSS of the process, from resource.getrusage"
CUDA_ALLOCATED = "torch.cuda.max_memory_allocated"


@dataclass
class StepClock:
    """The training steps this process ran: how many, which, their time and their tokens."""
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    seconds: float = 0.0
    tokens: int = 0

    def add(self, step: int, seconds: float, tokens: int) -> None:
        """Step ``step`` (1-based, as logged) took ``seconds`` and trained on ``tokens`` tokens."""
        self.steps += 1
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        self.seconds += seconds
        self.tokens += tokens


@dataclass
class RunSummary:
    logged_steps: int
    final_step: int | None
    final_loss: float | None
    best_step: int | None
    best_loss: float | None
    wall_time_s: float
    steps_run: int
    first_step_run: int | None
    last_step_run: int | None
    step_time_s: float
    tokens: int
    tokens_per_s: float | None
    peak_memory_bytes: int | None
    peak_memory_source: str

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The summary as the run prints it, one ``  name: value`` line each."""
        if self.final_loss is None:
            final = best = "none (no step logged)"
        else:
            final = f"{self.final_loss:.4f} at step {self.final_step}"
            best = f"{self.best_loss:.4f} at step {self.best_step}"
        if self.steps_run:
            steps = f"step {self.first_step_run}" if self.steps_run == 1 else \
                f"steps {self.first_step_run}-{self.last_step_run}"
            wall = f"{self.wall_time_s:.1f} s, {self.step_time_s:.2f} s of it in training {steps}"
            rate = f"{self.tokens_per_s:.0f} ({self.tokens:,} training tokens in {self.step_time_s:.2f} s of {steps})"
        else:
            wall, rate = f"{self.wall_time_s:.1f} s, no training step in it", "none (no training step)"
        memory = (f"{self.peak_memory_bytes / 2**20:,.1f} MiB ({self.peak_memory_source})"
                  if self.peak_memory_bytes is not None else self.peak_memory_source)
        return [f"  final loss:       {final}", f"  best loss:        {best}", f"  wall time:        {wall}",
                f"  tokens/s:         {rate}", f"  peak memory:      {memory}"]


def summarize(records: list[dict], clock: StepClock, wall_time_s: float, device: torch.device,
              processes: int = 1) -> RunSummary:
    """The summary of a run whose metrics.jsonl holds ``records``, whose training steps in this process
    ``clock`` timed, and which has run for ``wall_time_s``."""
    finite = [(r["step"], float(r["loss"])) for r in records if math.isfinite(float(r["loss"]))]
    final_step, final_loss = (records[-1]["step"], float(records[-1]["loss"])) if records else (None, None)
    best_step, best_loss = min(finite, key=lambda p: p[1]) if finite else (None, None)
    peak, source = peak_memory(device)
    if processes > 1:
        source += ", main process"
    return RunSummary(logged_steps=len(records), final_step=final_step, final_loss=final_loss, best_step=best_step,
                      best_loss=best_loss, wall_time_s=wall_time_s, steps_run=clock.steps,
                      first_step_run=clock.first_step, last_step_run=clock.last_step, step_time_s=clock.seconds,
                      tokens=clock.tokens, tokens_per_s=clock.tokens / clock.seconds if clock.seconds > 0 else None,
                      peak_memory_bytes=peak, peak_memory_source=source)


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes, what they measure): CUDA's peak allocated by tensors on a CUDA device, else the process's
    peak RSS; (None, why) where the platform has no ``resource`` module (Windows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), CUDA_ALLOCATED
    try:
        import resource
    except ImportError:
        return None, "not measured: no peak RSS on this platform (no resource module)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    return rss_bytes, RSS if device.type == "cpu" else f"{RSS}; {device.type} memory not included"
