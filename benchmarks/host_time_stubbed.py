"""Host time of one GDN forward and backward with every Triton launch stubbed out (CPU).

At H = 16 the H200 waits for the host during DeltaNet / GDN backwards (ninth
session, docs/performance.md). The GPU run (`timing_gaps.py --host-profile`)
measures the whole host cost; this script isolates the Python side, on any
machine: Triton's ``JITFunction.run`` and ``Autotuner.run`` return at once, so
what is timed is the op's Python (rewy's or FLA's wrappers, argument checks,
tensor allocation, autograd) without the launches themselves. Inputs are tiny
CPU tensors so that the torch ops between launches cost their dispatch only.
The numbers compare the two sides on one machine; they are not the H200
host's times.

    python -P benchmarks/host_time_stubbed.py --side rewy --policy recompute
    REWY_HF_STATE_BLOCK_V=fla python -P benchmarks/host_time_stubbed.py --side rewy
    python -P benchmarks/host_time_stubbed.py --side fla
    REWY_HF_STATE_BLOCK_V=fla REWY_HF_DIRECT_LAUNCH=1 python -P benchmarks/host_time_stubbed.py --stub jit

``--stub jit`` keeps the autotuners' and heuristics' Python in the time (only the
jit functions return at once), which is what REWY_HF_DIRECT_LAUNCH=1 removes.

At this script's one sequence x one head, rewy's default launches FLA's state
recurrences itself, at BV 16, as at (1, 16384, 16); with ``fla`` it goes
through FLA's launch functions, as at the other bench shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def _stub_launches(stub: str) -> None:
    """``all``: Triton's jit functions and autotuners return at once. ``jit``: only the jit
    functions do; the autotuners and heuristics (FLA's caching autotuner among them) run their
    Python, with every config timed as equally fast (the first wins), so that what a direct
    launch (REWY_HF_DIRECT_LAUNCH=1) skips is in the time."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    JITFunction.run = lambda self, *a, **k: None
    if stub == "all":
        Autotuner.run = lambda self, *a, **k: None
    else:
        Autotuner._bench = lambda self, *a, config, **k: [1.0, 1.0, 1.0]

        def tune_without_disk_cache(self, tuning_key, configs, bench_fn):
            bench_fn()                      # the disk cache of picks needs a GPU driver to name its target
            return False

        Autotuner.check_disk_cache = tune_without_disk_cache


def _op(side: str, policy: str):
    import torch
    import torch.nn.functional as F

    B, T, H, K, V = 1, 64, 1, 128, 128
    q = torch.randn(B, T, H, K).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K), dim=-1).bfloat16()
    v = torch.randn(B, T, H, V).bfloat16()
    leaves = [t.requires_grad_() for t in (q, k, v, F.logsigmoid(torch.randn(B, T, H)), torch.rand(B, T, H))]
    if side == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return leaves, lambda: chunk_gated_delta_rule(*leaves)[0]
    import rewy_hf
    from rewy_hf import ops, validation

    # CPU tensors: let backend="triton" through the device check (the launches are stubbed anyway)
    resolve = validation.resolve_backend
    ops.resolve_backend = lambda backend, device, why: "triton" if backend == "triton" else resolve(backend, device,
                                                                                                    why)
    return leaves, lambda: rewy_hf.chunk_gated_delta_rule(*leaves, backend="triton", policy=policy)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["rewy", "fla"], default="rewy")
    p.add_argument("--policy", choices=["recompute", "full"], default="recompute", help="rewy's save policy")
    p.add_argument("--calls", type=int, default=300, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stub", choices=["all", "jit"], default="all",
                   help="all: jit functions and autotuners return at once; jit: only the jit functions do")
    a = p.parse_args(argv)
    _stub_launches(a.stub)
    import torch

    warnings.simplefilter("ignore")
    leaves, forward = _op(a.side, a.policy)
    do = torch.randn_like(forward())
    times = {"forward": [], "backward": []}
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        outs = [forward() for _ in range(a.calls)]
        t1 = time.perf_counter()
        for o in outs:
            torch.autograd.grad(o, leaves, do, allow_unused=True)
        t2 = time.perf_counter()
        times["forward"].append((t1 - t0) / a.calls * 1e3)
        times["backward"].append((t2 - t1) / a.calls * 1e3)
    label = a.side + (f", policy {a.policy}" if a.side == "rewy" else "")
    stubbed = "launches stubbed" if a.stub == "all" else "jit functions stubbed"
    print(f"GDN, {label}, {stubbed}, ms per call over {a.repeats} x {a.calls}: "
          + "; ".join(f"{n} min {min(v):.3f} median {statistics.median(v):.3f}" for n, v in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
