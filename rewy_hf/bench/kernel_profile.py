"""Where one call spends its time, kernel by kernel, from one run under torch.profiler.

A speed-up says which side is faster; this says where each side's time goes:
the device time of every kernel summed over its launches, with the launch
count, so two sides can be laid next to each other stage by stage (`rewy-hf
bench --kernel-profile`). On a GPU the entries are kernels (memsets left out:
they are the allocator's, not the op's); on the CPU, where the torch backend
runs as ATen operators, they are the operators' self times, so no time is
counted twice where one operator calls another.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import torch

# Long C++ template names are cut here; the cut keeps them apart in practice and keeps tables readable.
NAME_CHARS = 90


def summed(events: Iterable, device: str) -> dict[str, dict]:
    """{name: {"ms": summed time, "launches": count}} of the profiler ``events`` that ran on ``device``
    ("cuda": kernels' device time; "cpu": operators' self CPU time)."""
    out: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "launches": 0})
    for e in events:
        kind = e.device_type.name
        if device == "cuda" and kind == "CUDA" and "Memset" not in e.name:
            ms = (e.time_range.end - e.time_range.start) / 1000.0
        elif device != "cuda" and kind == "CPU":
            ms = e.self_cpu_time_total / 1000.0
        else:
            continue
        entry = out[e.name[:NAME_CHARS]]
        entry["ms"] += ms
        entry["launches"] += 1
    return dict(out)


def kernel_times(run: Callable[[], None], device: str) -> dict[str, dict]:
    """``summed`` over one call of ``run`` (already warm: a first call would profile autotuning)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    return summed(prof.events(), device)


def largest(times: dict[str, dict], top: int) -> tuple[list[tuple[str, float, int]], tuple[int, float, int]]:
    """The ``top`` entries by time as (name, ms, launches), and the rest as (entries, ms, launches)."""
    ranked = sorted(times.items(), key=lambda kv: -kv[1]["ms"])
    head = [(name, v["ms"], v["launches"]) for name, v in ranked[:top]]
    rest = [v for _, v in ranked[top:]]
    return head, (len(rest), sum(v["ms"] for v in rest), sum(v["launches"] for v in rest))
