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

``--baseline DIR`` also runs another version of the kernels on the same
inputs: DIR holds that version's ``wy_backward.py`` / ``intra_backward.py``
(kernels/triton_backend/vector_gate/) and ``local_backward.py``
(kernels/triton_backend/scalar_gate/), for example from
``git show main:kernels/triton_backend/vector_gate/wy_backward.py``, each run with its
own first listed config. The script prints its time next to the current
first config's and the relative difference of their outputs (counted
against ``--tolerance`` too), so a kernel change is timed in one process
against what it replaces.

Kernels (``--kernel``, several allowed):
  kda-intra, gdn2-intra  stage 2 of the KDA / GDN2 backward (Matrix Intra)
  kda-wy, gdn2-wy        stage 1 (Residual WY)
  gdn-local              the GDN local kernel

Usage: python $REPO/dev/kernel_configs.py --kernel kda-intra gdn-local [--B 2 --T 8192 --H 16] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

from rewy_hf.cpu_triton import only_config
from rewy_hf.rel_error import rel_err


DEVICE = "cuda"


def _rand(gen):
    return lambda *s: torch.randn(*s, device=DEVICE, generator=gen)


def _log2_gates(x, BT=64):
    """Log-sigmoid gates as FLA keeps them: chunk-local cumulative sums in log2 units (T % BT == 0)."""
    from rewy_hf.kernels.constants import RCP_LN2

    B, T = x.shape[:2]
    y = F.logsigmoid(x).reshape(B, T // BT, BT, *x.shape[2:]).cumsum(2) * RCP_LN2
    return y.reshape(x.shape).contiguous()


def inputs(kind: str, B, T, H, K, V, seed=0) -> dict:
    """Random inputs of one local backward stage: ``kind`` "kda" or "gdn2" (the WY kernel's, vector
    gates) or "gdn" (the GDN local kernel's, one gate per token)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = _rand(gen)
    u = lambda *s: torch.rand(*s, device=DEVICE, generator=gen)    # noqa: E731
    NT = T // 64
    bf = torch.bfloat16 if DEVICE == "cuda" else torch.float32    # the interpreter's bf16 dot is wrong
    x = dict(q=r(B, T, H, K).to(bf), k=F.normalize(r(B, T, H, K), dim=-1).to(bf), v=r(B, T, H, V).to(bf),
             v_new=r(B, T, H, V).to(bf), g=_log2_gates(r(B, T, H) if kind == "gdn" else r(B, T, H, K)),
             beta=(u(B, T, H, K) if kind == "gdn2" else u(B, T, H)).to(bf),
             A=(0.1 * r(B, T, H, 64)).to(bf), h=(0.1 * r(B, NT, H, K, V)).to(bf),
             dh=(0.1 * r(B, NT, H, K, V)).to(bf), do=r(B, T, H, V).to(bf), dv2=r(B, T, H, V).to(bf), scale=K ** -0.5)
    if kind != "gdn":
        x["A"] = x["A"].tril()
    if kind == "gdn2":
        x["w_gate"] = u(B, T, H, V).to(bf)
    return x


def _same(a, b):
    (kw_a, c_a), (kw_b, c_b) = a, b
    return kw_a == kw_b and c_a.all_kwargs() == c_b.all_kwargs()


def _modules():
    """rewy's (Residual WY, Matrix Intra, GDN local) kernel modules."""
    from rewy_hf.kernels.triton_backend.scalar_gate import local_backward
    from rewy_hf.kernels.triton_backend.vector_gate import intra_backward, wy_backward

    return wy_backward, intra_backward, local_backward


def sweeps(name: str):
    """(wrapper keyword arguments, triton.Config) pairs to time: the kernel's current autotune list
    first (its first config is the reference), then configs outside it."""
    from rewy_hf.kernels.triton_backend.vector_gate import common

    WY, INTRA, G = _modules()

    C = triton.Config
    if name.endswith("intra"):
        listed = [({"block_k": common.INTRA_BLOCK_K}, c) for c in INTRA.rewy_kda_bwd_intra_kernel.configs]
        # an earlier sweep also covered width 16 and 1 stage with 4 or 8 warps: all slower
        extra = [(64, 2, 4), (64, 1, 2), (64, 1, 3), (128, 2, 2), (128, 2, 3), (128, 4, 2), (128, 4, 3),
                 (32, 1, 3), (32, 2, 3), (32, 2, 2), (32, 4, 2), (32, 8, 1),
                 # register caps at the shipped shape: 255 registers allow 4 two-warp programs per SM,
                 # 168 allow 6 and 128 allow 8, at the price of spills (dev/kernel_registers.py)
                 (64, 2, 3, 168), (64, 2, 3, 128), (64, 2, 2, 168), (32, 4, 3)]
        make = lambda bk, nw, ns, reg=None: ({"block_k": bk}, C({}, num_warps=nw, num_stages=ns,    # noqa: E731
                                                                maxnreg=reg))
    elif name.endswith("wy"):
        listed = [({}, c) for c in WY.rewy_kda_bwd_wy_kernel.configs]
        # 4 warps with 2 or 3 stages gave different outputs from one run to the next on the H200
        # (triton 3.6.0, docs/studies.md): kept here so the rerun check keeps watching them.
        # A maxnreg cap with 4 warps gave outputs 1e-2 off; it is not swept.
        extra = [(32, 4, 1), (64, 8, 2), (128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3), (32, 4, 2),
                 (32, 4, 3), (32, 8, 2), (32, 8, 3),
                 # 32-channel key blocks: 182 / 125 registers without spills (offline), against 255 with
                 # spills at 64; their programs share the chunk's value-side tiles through L2
                 (128, 4, 1, 32), (64, 4, 1, 32), (64, 8, 3, 32)]
        make = lambda bv, nw, ns, bk=None: ({"block_k": bk} if bk else {},    # noqa: E731
                                            C({"BV": bv}, num_warps=nw, num_stages=ns))
    elif name == "gdn-local":
        listed = [({"block_k": 64}, c) for c in G._CONFIGS]
        extra = [p for p in itertools.product((64, 128), (64, 32, 128), (4, 8), (1, 2, 3))
                 if not (p[0] == 128 and p[2] == 4)]
        make = lambda bk, bv, nw, ns: ({"block_k": bk}, C({"BV": bv}, num_warps=nw, num_stages=ns))    # noqa: E731
    else:
        raise ValueError(name)
    out = list(listed)
    for p in extra:
        cand = make(*p)
        if not any(_same(cand, o) for o in out):
            out.append(cand)
    return out


def stage(name: str, B, T, H, K, V, impl=None):
    """(kernel, fn(**wrapper_kwargs) -> tuple of outputs). ``impl``: (Residual WY, Matrix Intra, GDN
    local) modules of another version of the kernels, run on the same inputs (which the current
    modules make)."""
    WY, INTRA, G = _modules()
    WI, II, GI = impl or (WY, INTRA, G)
    if name.endswith("intra"):
        x = inputs(name.split("-")[0], B, T, H, K, V)
        dq, dk, dG, dv, dw, db, dL = WY.rewy_kda_bwd_wy(**x)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        dAqk = (0.1 * torch.randn(B, T, H, 64, device=DEVICE, generator=gen)).contiguous()
        args = dict(q=x["q"], k=x["k"], g=x["g"], beta=x["beta"], dAqk=dAqk, dL=dL, dq=dq, dk=dk, dG=dG, db_part=db)
        return II.rewy_kda_bwd_intra_kernel, lambda **kw: II.rewy_kda_bwd_intra(**args, inplace=False, **kw)
    if name.endswith("wy"):
        x = inputs(name.split("-")[0], B, T, H, K, V)
        return WI.rewy_kda_bwd_wy_kernel, lambda **kw: WI.rewy_kda_bwd_wy(**x, **kw)
    if name == "gdn-local":
        x = inputs("gdn", B, T, H, K, V)
        return GI.rewy_gdn_bwd_local_kernel, lambda **kw: GI.rewy_gdn_bwd_local(**x, **kw)
    raise ValueError(name)


def load_baseline(folder: str):
    """(Residual WY, Matrix Intra, GDN local) modules from another version's kernel files in
    ``folder``; a missing file falls back to the current module, so one changed file is enough; the
    helpers the files import (tiles.py, common.py) come from the current package."""
    current_modules = _modules()
    mods = []
    for current in current_modules:
        path = os.path.join(folder, os.path.basename(current.__file__))
        if not os.path.exists(path):
            mods.append(current)
            continue
        # named inside the current module's package, so the file's relative imports resolve to the
        # current package's helpers
        spec = importlib.util.spec_from_file_location(
            f"{current.__package__}.baseline_{os.path.basename(path)[:-3]}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    if all(m is c for m, c in zip(mods, current_modules)):
        names = ", ".join(os.path.basename(m.__file__) for m in current_modules)
        raise FileNotFoundError(f"{folder} holds none of {names}")
    return tuple(mods)


def run_baseline(name: str, a, ref, ms_ref) -> float:
    """The other version's kernel (its first listed config) on the same inputs: time and difference."""
    kern, fn = stage(name, a.B, a.T, a.H, a.K, a.V, impl=a.baseline_modules)
    with only_config(kern, kern.configs[0]):
        outs = comparable(name, fn())
        diff = max(rel_err(o, r) for o, r in zip(outs, ref))
        ms = triton.testing.do_bench(lambda: fn(), return_mode="median") if DEVICE == "cuda" else float("nan")
    print(f"  baseline {a.baseline}: {ms:8.3f} ms against {ms_ref:8.3f} ms for the current first config"
          f" ({ms / ms_ref:.3f}x the current time); diff {diff:.1e}", flush=True)
    return diff


def comparable(name: str, outs) -> list:
    """A stage's outputs as compared across configs (copies; None outputs dropped). KDA's Residual WY
    writes its erase-gate partials into one slot per key block plus the value side's, so configs with
    other key blocks differ in that buffer's width: their sum over the slots is what the next stage uses."""
    outs = list(outs)
    if name == "kda-wy":
        outs[5] = outs[5].sum(-1)
    return [o.clone() for o in outs if o is not None]


def run_kernel(name: str, a) -> float:
    kern, fn = stage(name, a.B, a.T, a.H, a.K, a.V)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU interpreter (no timing)"
    print(f"\n{name} at (B, T, H, K, V) = ({a.B}, {a.T}, {a.H}, {a.K}, {a.V}); {where}", flush=True)
    sweep = sweeps(name)       # reads the kernel's autotune list: before it is replaced below
    sweep = [sweep[i] for i in a.pick if i < len(sweep)] if a.pick else sweep[:a.limit or None]
    ref, rows, worst, ms_first = None, [], 0.0, float("nan")
    t_end = time.time() + a.budget
    for kw, cfg in sweep:
        if time.time() > t_end:
            print("  budget spent; later configs skipped", flush=True)
            break
        label = " ".join([f"{k}={v}" for k, v in {**kw, **cfg.kwargs}.items()]
                         + [f"warps={cfg.num_warps}", f"stages={cfg.num_stages}"]
                         + ([f"maxnreg={cfg.maxnreg}"] if cfg.maxnreg else []))
        with only_config(kern, cfg):
            t0 = time.time()
            try:
                outs = comparable(name, fn(**kw))
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                # the same config again on the same inputs: any difference is a race or a miscompile
                rerun = max((rel_err(o, r) for _ in range(a.repeat - 1)
                             for o, r in zip(comparable(name, fn(**kw)), outs)), default=0.0)
            except Exception as e:    # noqa: BLE001 - a config that cannot compile is a result, not a failure
                print(f"  {label}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})", flush=True)
                continue
            compile_s = time.time() - t0
            ms = triton.testing.do_bench(lambda: fn(**kw), return_mode="median") if DEVICE == "cuda" else float("nan")
        if ref is None:
            ref = outs
            diffs = [0.0] * len(outs)
        else:
            diffs = [rel_err(o, r) for o, r in zip(outs, ref)]
        diff = max(diffs + [rerun])
        worst = max(worst, diff)
        rows.append((ms, label, diff))
        if len(rows) == 1:
            ms_first = ms
        per = " ".join(f"{d:.0e}" for d in diffs)
        print(f"  {ms:8.3f} ms  diff {diff:.1e} [per output {per}; rerun {rerun:.0e}]"
              f"  (first call {compile_s:5.1f} s)  {label}", flush=True)
    if a.baseline and ref is not None:
        worst = max(worst, run_baseline(name, a, ref, ms_first))
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
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="a folder with another version's wy_backward.py / intra_backward.py / local_backward.py, timed on the same inputs")
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
    if a.baseline:
        if not os.path.isdir(a.baseline):
            p.error(f"--baseline {a.baseline}: no such folder (put the other version's kernel files there)")
        try:
            a.baseline_modules = load_baseline(a.baseline)     # once, for every kernel of the run
        except FileNotFoundError as e:
            p.error(f"--baseline: {e}")
    worst = max(run_kernel(n, a) for n in a.kernel)
    return 0 if worst <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
