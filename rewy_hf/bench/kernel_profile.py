"""Where one call spends its time, kernel by kernel, from one run under torch.profiler: each kernel's
device time summed over its launches, with the launch count (memsets left out: they are the
allocator's); on the CPU, ATen operators' self times, so that nothing counts twice. A model-level
step's kernels are summed by family (KERNEL_GROUPS); dev/bench_lab's --kernel-profile lists an op's
kernel by kernel."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import torch

# Long C++ template names are cut here; the cut keeps them apart in practice and keeps tables readable.
NAME_CHARS = 90
# The name fragments of the delta-rule kernels: FLA's chunk stages and rewy's.
DELTA_RULE = ("chunk_", "rewy_", "recompute_w_u", "prepare_wy", "l2norm", "solve_tril", "merge_16x16")
KERNEL_GROUPS = ("core", "gemm", "elementwise", "conv", "attention", "optimizer")


def kernel_group(name: str) -> str:
    """The group of a GPU kernel (KERNEL_GROUPS), by its name."""
    n = name.lower()
    if any(n.startswith(x) or x in n for x in DELTA_RULE):
        return "core"
    if any(x in n for x in ("adam", "multi_tensor_apply", "foreach")):
        return "optimizer"
    if any(x in n for x in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(x in n for x in ("conv", "fprop", "dgrad", "wgrad")):
        return "conv"
    if any(x in n for x in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")):
        return "gemm"
    return "elementwise"


def short_name(name: str) -> str:
    return name[:NAME_CHARS]


def summed(events: Iterable, device: str, key: Callable[[str], str] = short_name) -> dict[str, dict]:
    """{key(name): {"ms": summed time, "launches": count}} of the profiler ``events`` that ran on ``device``
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
        entry = out[key(e.name)]
        entry["ms"] += ms
        entry["launches"] += 1
    return dict(out)


def kernel_times(run: Callable[[], None], device: str, key: Callable[[str], str] = short_name) -> dict[str, dict]:
    """``summed`` over one call of ``run`` (already warm: a first call would profile autotuning)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    return summed(prof.events(), device, key)


def gpu_time_by_group(step) -> dict:
    """Summed kernel ms, ms per kernel group and kernel launches of one call of ``step`` on the GPU
    (the JSON key ``gpu_ms_by_family`` is the published files' name for the groups)."""
    by_group = kernel_times(step, "cuda", kernel_group)
    per = {f: by_group[f]["ms"] if f in by_group else 0.0 for f in KERNEL_GROUPS}
    return {"gpu_ms": sum(per.values()), "gpu_ms_by_family": per,
            "launches": sum(v["launches"] for v in by_group.values())}
