"""Where the op bench's backward time goes beyond the kernels' own time (CUDA).

``rewy-hf bench`` times one backward with ``triton.testing.do_bench`` (median,
L2 flushed before each run). In the seventh session that time exceeded the sum
of the backward's kernel times (torch.profiler) by about the same amount on
both sides (0.15 ms at (2, 8192, 16), 0.31 ms at (1, 16384, 16), KDA full),
which pulls the ratio of the faster side down. This script measures, for the
bench's own inputs and sides, per backward:

  bench    do_bench median, as the bench does
  chained  N backward calls between two events, no flush, divided by N
  cpu      host time to issue one backward (no synchronize): above the GPU
           time, the measurement is bound by Python and launches, not kernels
  gpu      the GPU's own time for one backward: N calls queued behind a spin
           kernel (torch.cuda._sleep) long enough for the host to issue them
           all, timed from its end; kernels on a second stream count once, as
           they overlap, so this column is the one that shows an overlap
  kernels  sum of the device times of the kernels of one profiled call
           (gdn_bwd_stages.kernel_times, memsets left out; the eighth
           session's runs averaged five calls with memsets counted)

Autotune picks are forgotten before each shape, as the bench now does (the
eighth session's runs of this script predate that: they ran (2, 8192, 16)
first, whose picks are also the best ones at (1, 16384, 16)).

``--per-kernel`` lists, per shape and side, each kernel of the profiled call
with its device time (the per-kernel breakdown behind the ``kernels`` sum).

``--host-profile`` adds, per shape and side, the Python functions that take
the host's time while it issues a backward (cProfile over 20 calls without
a synchronize, top entries by own time, ms per backward). The ninth session
found DeltaNet and GDN at H = 16 about as long on the host as on the GPU.

``--dhu-configs`` instead times FLA's reverse state recurrence
(``chunk_gated_delta_rule_bwd_dhu``, per-key gates as KDA calls it), which both
sides run, under each of its autotune configs. Its autotune key has neither B
nor T, so a process keeps the config tuned at the first shape it sees.

``--state-widths`` times both of FLA's sequential state recurrences (fwd_h
and bwd_dhu) under FLA's own launch and under rewy's launch of the same
kernels at each value-block width (kernels/state_launch.py, BV 64, 32, 16),
per-key (KDA) and per-head (GDN) gates, outputs checked against FLA's launch;
it names the width that the default rule (REWY_HF_STATE_BLOCK_V=auto) picks at each shape
(fla: FLA's launch).

    python benchmarks/timing_gaps.py --op kda --policy full --shapes 2,8192,16 1,16384,16 --sides rewy fla

(without -P: the script imports its neighbours in benchmarks/, which Python puts on
sys.path as the script's folder; the repository root, with its kernels/, is not.)
"""

from __future__ import annotations

import argparse
import sys
import time


def measure(run, n: int = 20) -> dict:
    import torch
    import triton.testing

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    out = {"bench": float(triton.testing.do_bench(run, warmup=1, rep=200, return_mode="median"))}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        run()
    end.record()
    torch.cuda.synchronize()
    out["chained"] = start.elapsed_time(end) / n
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    out["cpu"] = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    out["gpu"] = gpu_only(run, out["cpu"], n)
    from gdn_bwd_stages import kernel_times     # this folder is on sys.path when the script runs

    out["per_kernel"] = kernel_times(run)
    out["kernels"] = sum(ms for _, ms in out["per_kernel"])
    return out


def gpu_only(run, host_ms: float, n: int) -> float:
    """Device time per call of ``run`` with the host's issuing hidden behind a spin kernel: the
    start event runs after the spin, by when all n calls are queued (checked: NaN otherwise)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    ms_per_mcycle = start.elapsed_time(end)
    pad_ms = 1.5 * host_ms * n + 5.0
    torch.cuda._sleep(int(pad_ms / ms_per_mcycle * 1e6))
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    end.record()
    issued_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    # the spin must outlast the issuing, or the GPU waited for the host inside the timed span
    return start.elapsed_time(end) / n if issued_ms < 0.9 * pad_ms else float("nan")


def host_profile(run, n: int = 20, top: int = 12) -> list[str]:
    """The ``top`` functions by own host time over ``n`` unsynchronized calls, in ms per call."""
    import cProfile
    import pstats

    import torch

    run()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        run()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats      # {(file, line, name): (calls, ncalls, own, cumulative, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.values()) * 1e3 / n
    lines = [f"    host total {total:.3f} ms per backward (under cProfile, which adds its own cost)"]
    for (path, line, name), (_, calls, own, cum, _) in rows:
        where = "/".join(path.split("/")[-2:]) + f":{line}"
        lines.append(f"    {own * 1e3 / n:7.3f} own {cum * 1e3 / n:7.3f} cum {calls / n:5.1f}x  {name} ({where})")
    return lines


def dhu_configs(shapes) -> None:
    import triton
    import triton.testing
    from fla.ops.common import chunk_delta_h
    from state_scan_timing import inputs, sides     # this folder is on sys.path when the script runs

    from rewy_hf.autotune_picks import autotuner_of
    from rewy_hf.cpu_triton import only_config

    tuner = autotuner_of(chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64)
    configs = list(tuner.configs)
    print(f"FLA bwd_dhu, per-key gates, K = V = 128: ms per call under each of its {len(configs)} configs",
          flush=True)
    for B, T, H in shapes:
        text = f"{B},{T},{H}"
        fla_bwd_dhu = sides(inputs("kda", B, T, H), 1)["backward"][0]
        times = []
        for cfg in configs:
            with only_config(tuner, cfg):
                try:
                    times.append(float(triton.testing.do_bench(fla_bwd_dhu, rep=100, return_mode="median")))
                except triton.runtime.errors.OutOfResources:   # FLA's autotuner skips these too
                    times.append(float("inf"))
        order = sorted(range(len(configs)), key=times.__getitem__)
        print(f"  ({text}): " + ", ".join(f"{times[i]:.3f} [{configs[i]}]" for i in order[:4])
              + f" ... slowest {times[order[-1]]:.3f}", flush=True)


def state_widths(shapes) -> None:
    import os

    import triton.testing
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from state_scan_timing import inputs     # this folder is on sys.path when the script runs

    from rewy_hf.autotune_picks import forget_picks
    from rewy_hf.kernels import state_launch
    from rewy_hf.rel_error import rel_err

    widths = ("fla", *map(str, state_launch.WIDTHS))
    print("state recurrences, K = V = 128, ms per call, fwd_h / bwd_dhu; rewy's launch of FLA's kernels at each "
          "BV (worst relative error of its outputs against FLA's launch)", flush=True)
    saved = os.environ.get(state_launch.STATE_BLOCK_V_ENV)
    try:
        for kind in ("kda", "gdn"):
            for B, T, H in shapes:
                text = f"{B},{T},{H}"
                forget_picks()
                x = inputs(kind, B, T, H)
                fwd = lambda: state_launch.fwd_h(      # noqa: E731
                    chunk_gated_delta_rule_fwd_h, k=x["k"], w=x["w"], u=x["u"], g=x["g"], gk=x["gk"],
                    initial_state=x["h0"], output_final_state=True)
                bwd = lambda: state_launch.bwd_dhu(    # noqa: E731
                    chunk_gated_delta_rule_bwd_dhu, q=x["q"], k=x["k"], w=x["w"], do=x["do"], dv=x["dv"], g=x["g"],
                    gk=x["gk"], h0=x["h0"], dht=x["dht"], scale=x["scale"])
                cells, ref = [], None
                for width in widths:
                    os.environ[state_launch.STATE_BLOCK_V_ENV] = width
                    outs = [*fwd(), *bwd()]
                    if ref is None:         # FLA's launch, the first width
                        ref = outs
                    err = max(rel_err(a, b) for a, b in zip(outs, ref))
                    ms = [float(triton.testing.do_bench(fn, rep=100, return_mode="median")) for fn in (fwd, bwd)]
                    cells.append(f"{width}: {ms[0]:.3f} / {ms[1]:.3f}" + ("" if width == "fla" else f" ({err:.0e})"))
                pick = state_launch.narrow_block_v(B, H, 128) or "fla"
                print(f"  {kind} ({text}): " + ", ".join(cells) + f"; auto picks {pick}", flush=True)
    finally:
        if saved is None:
            os.environ.pop(state_launch.STATE_BLOCK_V_ENV, None)
        else:
            os.environ[state_launch.STATE_BLOCK_V_ENV] = saved


def main(argv=None) -> int:
    from state_scan_timing import shape_arg     # this folder is on sys.path when the script runs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="kda", choices=["delta_rule", "gdn", "kda", "gdn2"])
    p.add_argument("--policy", default="full", choices=["recompute", "full"])
    p.add_argument("--shapes", nargs="+", type=shape_arg, default=[(2, 8192, 16), (1, 16384, 16)], metavar="B,T,H")
    p.add_argument("--sides", nargs="+", default=["rewy", "fla"], choices=["rewy", "fla"])
    p.add_argument("--dhu-configs", action="store_true", help="time FLA's bwd_dhu under each of its configs")
    p.add_argument("--state-widths", action="store_true",
                   help="time FLA's fwd_h / bwd_dhu under FLA's launch and rewy's at each value-block width")
    p.add_argument("--host-profile", action="store_true",
                   help="also list the Python functions that take the host's time per backward (cProfile)")
    p.add_argument("--per-kernel", action="store_true",
                   help="also list each kernel of the profiled backward with its device time, in launch order")
    a = p.parse_args(argv)
    if a.dhu_configs:
        dhu_configs(a.shapes)
        return 0
    if a.state_widths:
        state_widths(a.shapes)
        return 0

    import torch

    from rewy_hf.autotune_picks import forget_picks
    from rewy_hf.bench_config import Shape
    from rewy_hf.bench_ops import fla_impl, lift_gdn_guard, make_inputs, rewy_impl
    from rewy_hf.bench_timing import runner

    guard = lift_gdn_guard() if a.op == "gdn" else {}
    print(f"{torch.cuda.get_device_name()}  op {a.op}  policy {a.policy}  (ms per backward)", flush=True)
    print(f"{'shape':>14s} {'side':5s} {'bench':>7s} {'chained':>8s} {'cpu':>7s} {'gpu':>7s} {'kernels':>8s}", flush=True)
    for B, T, H in a.shapes:
        text = f"{B},{T},{H}"
        forget_picks()      # as the bench does: each shape runs the configs tuned at it
        inputs, do = make_inputs(a.op, Shape(B, T, H, 128, 128), "cuda", torch.bfloat16, seed=0)
        for side in a.sides:
            impl = rewy_impl(a.op, "triton", a.policy) if side == "rewy" else fla_impl(a.op, a.policy, guard)
            run = runner("B", impl.fn, inputs, do)
            m = measure(run)
            print(f"{text:>14s} {side:5s} {m['bench']:7.3f} {m['chained']:8.3f} {m['cpu']:7.3f} {m['gpu']:7.3f} {m['kernels']:8.3f}",
                  flush=True)
            if a.per_kernel:
                print("\n".join(f"    {ms:7.3f}  {name[:90]}" for name, ms in m["per_kernel"]), flush=True)
            if a.host_profile:
                print("\n".join(host_profile(run)), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
