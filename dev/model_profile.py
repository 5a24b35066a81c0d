"""Where one model-level training step spends its GPU time, unpatched vs patched.

`rewy-hf bench --model` says how long a step takes; this says why. It builds a
model (a preset or hub id), runs warm-up steps on each side, then profiles one
step per side with torch.profiler and prints, per side, the step's wall time
next to its summed kernel time (when the wall time is much larger, the CPU
launch path rather than the GPU bounds the step), the delta-rule kernels
(FLA's chunk stages and rewy's), and where the sides differ most: device time
and launches per kernel, and host (self CPU) time per op. FLA's GDN guard (Hopper, Triton < 3.7.1) is lifted for
the unpatched side: its time is valid, its gradients are not used.

Usage: python $REPO/dev/model_profile.py --model qwen3.5-1b --seq-len 4096
"""

from __future__ import annotations

import argparse
import time

import torch

from rewy_hf.bench.kernel_profile import DELTA_RULE, summed


def kernel_totals(fn) -> tuple[float, dict[str, float], int, dict[str, int], dict[str, float]]:
    """(wall ms of one call, device ms per kernel name summed over launches, kernel launches,
    launches per kernel name, host ms per CPU op name)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = summed(prof.events(), "cuda")
    host = {name: v["ms"] for name, v in summed(prof.events(), "cpu").items()}
    totals = {name: v["ms"] for name, v in kernels.items()}
    counts = {name: v["launches"] for name, v in kernels.items()}
    launches = sum(counts.values())
    return wall, totals, launches, counts, host


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.5-1b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--backend", default="triton")
    p.add_argument("--policy", default="recompute")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()

    from rewy_hf.bench.model_bench import ModelSettings, ModelSides, optimizer_for, train_step
    from rewy_hf.bench.op_bench import lift_gdn_guard
    from rewy_hf.models.loading import load_causal_lm

    lift_gdn_guard()
    model = load_causal_lm(a.model, dtype=torch.bfloat16, device="cuda").model.train()
    s = ModelSettings(device="cuda", steps=1, warmup=a.warmup, batch_size=a.batch_size, seq_len=a.seq_len,
                      backend=a.backend, policy=a.policy, seed=0)
    batch = torch.randint(0, model.config.vocab_size, (a.batch_size, a.seq_len), device="cuda")
    opt = optimizer_for(model, 1e-5)
    sides = ModelSides(model, s)
    result = {}
    for side in ("unpatched", "patched"):
        with sides.enter(side):
            for _ in range(a.warmup):
                train_step(model, opt, batch)
            result[side] = kernel_totals(lambda: train_step(model, opt, batch))
    print(f"{a.model}, {a.batch_size} x {a.seq_len} tokens, bf16, backend {a.backend}, policy {a.policy}; "
          f"{torch.cuda.get_device_name()}, one profiled step per side after {a.warmup} warm-up steps")
    for side, (wall, totals, launches, _, host) in result.items():
        dr = {n: t for n, t in totals.items() if any(n.startswith(x) or x in n for x in DELTA_RULE)}
        print(f"\n{side}: wall {wall:.1f} ms, kernels {sum(totals.values()):.1f} ms in {launches} launches; "
              f"delta-rule kernels {sum(dr.values()):.2f} ms; host (self CPU, all ops) {sum(host.values()):.1f} ms")
        for n, t in sorted(dr.items(), key=lambda x: -x[1])[:a.top]:
            print(f"  {t:8.3f}  {n}")
    # Where the sides differ: device time per kernel and, since a launch-bound step is paid for on the
    # host, launches per kernel and host time per op.
    for title, i, dfmt, vfmt in (("device time (ms per step)", 1, "{:+8.3f}", "{:8.3f}"),
                                 ("kernel launches", 3, "{:+8d}", "{:8d}"),
                                 ("host time (self CPU ms)", 4, "{:+8.3f}", "{:8.2f}")):
        un, pa = result["unpatched"][i], result["patched"][i]
        diff = sorted(((pa.get(n, 0) - un.get(n, 0), n) for n in set(un) | set(pa)), key=lambda x: -abs(x[0]))
        print(f"\nlargest differences in {title}, patched - unpatched:")
        for d, n in diff[:a.top]:
            print(f"  {dfmt.format(d)}  unpatched {vfmt.format(un.get(n, 0))}  patched {vfmt.format(pa.get(n, 0))}"
                  f"  {n}")


if __name__ == "__main__":
    main()
