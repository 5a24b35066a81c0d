"""Launch configurations of rewy's backward kernels, one at a time, on the GPU.

The autotuners only ever see the configs listed in the kernel files. This
script times configs outside that list (fewer warps, software-pipelined
loops, other block widths) so the lists can be chosen from measurements.
For each kernel it replaces the autotuner's config list with one config,
runs the stage on the same random inputs, checks the outputs against the
first config's (relative difference per output: configs only reorder the
same products, so the script exits non-zero above ``--tolerance``, default
1e-3), reruns it ``--repeat`` - 1 more times and compares the runs (a
difference there is a race or a miscompile), and times it with
``triton.testing.do_bench`` (median). Configs that fail to compile or run
out of shared memory are printed as such and skipped. ``--device cpu``
(under ``TRITON_INTERPRET=1``) checks the plumbing and the agreement of
configs that split the work differently, without timing; the tests do that.

Kernels (``--kernel``, several allowed):
  kda-intra, gdn2-intra  stage 2 of the KDA / GDN2 backward (Matrix Intra)
  kda-wy, gdn2-wy        stage 1 (Residual WY)
  gdn-local              the GDN local kernel

Usage: python benchmarks/kernel_configs.py --kernel kda-intra gdn-local [--B 2 --T 8192 --H 16]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton


DEVICE = "cuda"


def _rand(gen):
    return lambda *s: torch.randn(*s, device=DEVICE, generator=gen)


def _log2_gates(x, BT=64):
    """Log-sigmoid gates as FLA keeps them: chunk-local cumulative sums in log2 units (T % BT == 0)."""
    B, T = x.shape[:2]
    y = F.logsigmoid(x).reshape(B, T // BT, BT, *x.shape[2:]).cumsum(2) * 1.4426950408889634
    return y.reshape(x.shape).contiguous()


def wy_inputs(vec: bool, B, T, H, K, V, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = _rand(gen)
    NT = T // 64
    bf = torch.bfloat16 if DEVICE == "cuda" else torch.float32    # the interpreter's bf16 dot is wrong
    x = dict(q=r(B, T, H, K).to(bf), k=F.normalize(r(B, T, H, K), dim=-1).to(bf), v=r(B, T, H, V).to(bf),
             v_new=r(B, T, H, V).to(bf), g=_log2_gates(r(B, T, H, K)),
             beta=(torch.rand(B, T, H, K, device=DEVICE, generator=gen) if vec
                   else torch.rand(B, T, H, device=DEVICE, generator=gen)).to(bf),
             A=(0.1 * r(B, T, H, 64)).tril().to(bf), h=(0.1 * r(B, NT, H, K, V)).to(bf),
             dh=(0.1 * r(B, NT, H, K, V)).to(bf), do=r(B, T, H, V).to(bf), dv2=r(B, T, H, V).to(bf), scale=K ** -0.5)
    if vec:
        x["w_gate"] = torch.rand(B, T, H, V, device=DEVICE, generator=gen).to(bf)
    return x


def gdn_inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = _rand(gen)
    NT = T // 64
    bf = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return dict(q=r(B, T, H, K).to(bf), k=F.normalize(r(B, T, H, K), dim=-1).to(bf), v=r(B, T, H, V).to(bf),
                v_new=r(B, T, H, V).to(bf), g=_log2_gates(r(B, T, H)),
                beta=torch.rand(B, T, H, device=DEVICE, generator=gen).to(bf),
                A=(0.1 * r(B, T, H, 64)).to(bf), h=(0.1 * r(B, NT, H, K, V)).to(bf),
                dh=(0.1 * r(B, NT, H, K, V)).to(bf), do=r(B, T, H, V).to(bf), dv2=r(B, T, H, V).to(bf),
                scale=K ** -0.5)


def sweeps(name: str):
    """(wrapper keyword arguments, triton.Config) pairs to time; the first is the reference."""
    C = triton.Config
    if name.endswith("intra"):
        # the chosen config first; the first sweep (2026-11-30) covered widths 16/32/64 x 1/2/4/8 warps x 1/2/3
        # stages with 8 warps and one stage first
        picks = [(64, 2, 3), (64, 2, 2), (64, 4, 3), (64, 2, 4), (64, 1, 2), (64, 1, 3), (128, 2, 2), (128, 2, 3),
                 (128, 4, 2), (128, 4, 3), (32, 1, 3), (32, 2, 3), (32, 8, 1)]
        return [({"block_k": bk}, C({}, num_warps=nw, num_stages=ns)) for bk, nw, ns in picks]
    if name.endswith("wy"):
        # maxnreg only with 8 warps: with 4 warps and a cap the compiled kernel gave outputs 1e-2 off
        # the other configs' on the H200 (2026-11-30). 4 warps with 2 or 3 stages gave different outputs
        # from one run to the next (up to 8e-3 in dq and dk: triton 3.6.0, see docs/performance.md), so
        # they stay out of the autotune list; 1 stage (no software pipelining) is the open question.
        picks = [(64, 8, 2), (64, 4, 1), (32, 4, 1), (128, 4, 1), (128, 8, 2), (128, 8, 3), (64, 8, 3),
                 (64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (32, 8, 2), (32, 8, 3)]
        return [({}, C({"BV": bv}, num_warps=nw, num_stages=ns)) for bv, nw, ns in picks]
    if name == "gdn-local":
        # the autotune list first (triton_gdn_bwd._CONFIGS), then the rest of the first sweep's grid
        picks = [(64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2)]
        for pick in itertools.product((64, 128), (64, 32, 128), (4, 8), (1, 2, 3)):
            if pick not in picks and not (pick[0] == 128 and pick[2] == 4):
                picks.append(pick)
        return [({"block_k": bk}, C({"BV": bv}, num_warps=nw, num_stages=ns)) for bk, bv, nw, ns in picks]
    raise ValueError(name)


def stage(name: str, B, T, H, K, V):
    """(kernel, fn(**wrapper_kwargs) -> tuple of outputs)."""
    from rewy_hf.kernels import triton_gdn_bwd as G
    from rewy_hf.kernels import triton_kda_bwd as KB

    if name.endswith("intra"):
        vec = name.startswith("gdn2")
        x = wy_inputs(vec, B, T, H, K, V)
        dq, dk, dG, dv, dw, db, dL = KB.rewy_kda_bwd_wy(**x)
        dAqk = (0.1 * torch.randn(B, T, H, 64, device=DEVICE)).contiguous()
        args = dict(q=x["q"], k=x["k"], g=x["g"], beta=x["beta"], dAqk=dAqk, dL=dL, dq=dq, dk=dk, dG=dG, db_part=db)
        return KB.rewy_kda_bwd_intra_kernel, lambda **kw: KB.rewy_kda_bwd_intra(**args, inplace=False, **kw)
    if name.endswith("wy"):
        x = wy_inputs(name.startswith("gdn2"), B, T, H, K, V)
        return KB.rewy_kda_bwd_wy_kernel, lambda **kw: KB.rewy_kda_bwd_wy(**x, **kw)
    if name == "gdn-local":
        x = gdn_inputs(B, T, H, K, V)
        return G.rewy_gdn_bwd_local_kernel, lambda **kw: G.rewy_gdn_bwd_local(**x, **kw)
    raise ValueError(name)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_kernel(name: str, a) -> float:
    kern, fn = stage(name, a.B, a.T, a.H, a.K, a.V)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU interpreter (no timing)"
    print(f"\n{name} at (B, T, H, K, V) = ({a.B}, {a.T}, {a.H}, {a.K}, {a.V}); {where}", flush=True)
    saved = kern.configs
    ref, rows, worst = None, [], 0.0
    t_end = time.time() + a.budget
    try:
        sweep = sweeps(name)
        sweep = [sweep[i] for i in a.pick if i < len(sweep)] if a.pick else sweep[:a.limit or None]
        for kw, cfg in sweep:
            if time.time() > t_end:
                print("  budget spent; later configs skipped", flush=True)
                break
            kern.configs = [cfg]
            kern.cache.clear()
            label = " ".join([f"{k}={v}" for k, v in {**kw, **cfg.kwargs}.items()]
                             + [f"warps={cfg.num_warps}", f"stages={cfg.num_stages}"]
                             + ([f"maxnreg={cfg.maxnreg}"] if cfg.maxnreg else []))
            t0 = time.time()
            try:
                outs = [o.clone() for o in fn(**kw) if o is not None]
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                # the same config again on the same inputs: any difference is a race or a miscompile
                rerun = max((rel(o.clone(), r) for _ in range(a.repeat - 1)
                             for o, r in zip([o for o in fn(**kw) if o is not None], outs)), default=0.0)
            except Exception as e:    # noqa: BLE001 - a config that cannot compile is a result, not a failure
                print(f"  {label}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})", flush=True)
                continue
            compile_s = time.time() - t0
            if ref is None:
                ref = outs
                diffs = [0.0] * len(outs)
            else:
                diffs = [rel(o, r) for o, r in zip(outs, ref)]
            diff = max(diffs + [rerun])
            worst = max(worst, diff)
            ms = triton.testing.do_bench(lambda: fn(**kw), return_mode="median") if DEVICE == "cuda" else float("nan")
            rows.append((ms, label, diff))
            per = " ".join(f"{d:.0e}" for d in diffs)
            print(f"  {ms:8.3f} ms  diff {diff:.1e} [per output {per}; rerun {rerun:.0e}]"
                  f"  (first call {compile_s:5.1f} s)  {label}", flush=True)
    finally:
        kern.configs = saved
        kern.cache.clear()
    print(f"{name}: fastest first", flush=True)
    for ms, label, diff in sorted(rows)[:6]:
        print(f"  {ms:8.3f} ms  {label}", flush=True)
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", nargs="+", default=["kda-intra"],
                   choices=["kda-intra", "gdn2-intra", "kda-wy", "gdn2-wy", "gdn-local"])
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--budget", type=float, default=150.0, help="seconds per kernel; later configs are skipped")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest relative difference between configs (or reruns) the exit status accepts")
    p.add_argument("--repeat", type=int, default=1, help="run each config this many times and compare the runs")
    p.add_argument("--limit", type=int, default=0, help="time only the first N configs of each sweep (0: all)")
    p.add_argument("--pick", type=int, nargs="+", default=None, help="only these positions of each sweep")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a plumbing check under TRITON_INTERPRET=1 at a small shape, nothing timed")
    a = p.parse_args(argv)
    global DEVICE
    DEVICE = a.device
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu needs TRITON_INTERPRET=1 in the environment")
    if DEVICE == "cpu":
        from rewy_hf.cpu_triton import first_config_only

        first_config_only()     # the stages feeding the swept kernel cannot autotune without a GPU
    if a.T % 64:
        p.error("--T must be a multiple of 64")
    worst = max(run_kernel(n, a) for n in a.kernel)
    return 0 if worst <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
