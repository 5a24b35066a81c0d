"""KDA / GDN2 Triton backward on the H200: gradients vs an fp32 reference, then backward time vs FLA.

1. Check: at a small shape (B=2, T=1000 ragged, H=16, K=V=128, initial state and
   final-state gradient), for each op, gate kind (log-sigmoid; at FLA's safe
   lower bound -5, with ``safe_gate=True`` for FLA and for our forward) and
   policy, the relative Frobenius error of every gradient of rewy's Triton
   backward and of FLA 0.6.0's, both on the same BF16 inputs, against
   ``rewy_hf.chunk_kda/chunk_gdn2(..., backend="torch", policy="full")`` run
   on those values cast to fp32. "ok" means ours <= 1.1 x FLA's (+1e-6).
   Extras, time permitting: GVA, state_v_first, cu_seqlens.
2. Timing: median backward (``triton.testing.do_bench``, return_mode="median")
   of FLA vs ours at (2, 8192, 16) and (1, 32768, 32), BF16, K = V = 128,
   log-sigmoid gates, both policies, plus peak memory of one forward+backward,
   and a per-kernel profile of one backward at the first shape (full policy).

Sections past ``--budget`` seconds are skipped (printed as such). Everything is
printed with flush and copied to ``<out>/kda_gpu_check.log``.

    source tools/h200_env.sh && python3 benchmarks/kda_gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

T_START = time.time()
LOG = None
DEVICE = "cuda"


def log(*parts) -> None:
    msg = " ".join(str(p) for p in parts)
    print(msg, flush=True)
    if LOG is not None:
        LOG.write(msg + "\n")
        LOG.flush()


def elapsed() -> float:
    return time.time() - T_START


# --------------------------------------------------------------------------------------------
# inputs and the three implementations
# --------------------------------------------------------------------------------------------

def make_inputs(op, B, T, H, HV, K, V, gates, seed, N=None, v_first=False, with_state=True):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dev, bf = DEVICE, torch.bfloat16
    rn = lambda *s: torch.randn(*s, device=dev, generator=gen)
    N = B if N is None else N
    q = F.normalize(rn(B, T, H, K), dim=-1).to(bf)
    k = F.normalize(rn(B, T, H, K), dim=-1).to(bf)
    v = rn(B, T, HV, V).to(bf)
    if gates == "logsigmoid":
        g = F.logsigmoid(rn(B, T, HV, K))
    elif gates == "bound":          # at FLA's safe lower bound: g in (-5, 0), mostly near -5
        g = -5.0 * torch.sigmoid(rn(B, T, HV, K) + 3.0)
    else:
        raise ValueError(gates)
    x = dict(q=q, k=k, v=v, g=g.float())
    if op == "kda":
        x["beta"] = torch.rand(B, T, HV, device=dev, generator=gen).to(bf)
    else:
        x["b"] = (2 * torch.rand(B, T, H, K, device=dev, generator=gen)).to(bf)
        x["w"] = torch.rand(B, T, H, V, device=dev, generator=gen).to(bf)
    sshape = (N, HV, V, K) if v_first else (N, HV, K, V)
    x["h0"] = 0.3 * rn(*sshape) if with_state else None
    do = rn(B, T, HV, V).to(bf)
    dht = 0.3 * rn(*sshape) if with_state else None
    return x, do, dht


def names(op):
    return ["q", "k", "v", "g", "beta", "h0"] if op == "kda" else ["q", "k", "v", "g", "b", "w", "h0"]


def run_impl(impl, op, x, policy, scale, safe_gate=False, v_first=False, cu=None, fp32=False):
    """Forward with fresh leaves; returns (leaves, o, ht)."""
    import rewy_hf
    from fla.ops.gdn2 import chunk_gdn2 as fla_gdn2
    from fla.ops.kda import chunk_kda as fla_kda

    from rewy_hf.kernels.triton_kda import triton_gdn2_core, triton_kda_core

    leaves = {}
    for n in names(op):
        t = x[n]
        if t is None:
            leaves[n] = None
            continue
        t = t.detach().float() if fp32 else t.detach()
        leaves[n] = t.clone().requires_grad_()
    L = leaves
    gates = (L["beta"],) if op == "kda" else (L["b"], L["w"])
    has_state = L["h0"] is not None
    if impl == "fla":
        fn = fla_kda if op == "kda" else fla_gdn2
        o, ht = fn(L["q"], L["k"], L["v"], L["g"], *gates, scale=scale, initial_state=L["h0"],
                   output_final_state=has_state, disable_recompute=policy == "full", safe_gate=safe_gate,
                   state_v_first=v_first, cu_seqlens=cu)
    elif impl == "ours":
        core = triton_kda_core if op == "kda" else triton_gdn2_core
        o, ht = core(L["q"], L["k"], L["v"], L["g"], *gates, scale, L["h0"], has_state, v_first, policy,
                     safe_gate=safe_gate, cu_seqlens=cu)
    else:  # the fp32 reference: the torch backend's ReWY backward (float64-verified in CI)
        fn = rewy_hf.chunk_kda if op == "kda" else rewy_hf.chunk_gdn2
        o, ht = fn(L["q"], L["k"], L["v"], L["g"], *gates, scale=scale, initial_state=L["h0"],
                   output_final_state=has_state, state_v_first=v_first, cu_seqlens=cu, backend="torch",
                   policy="full")
    return leaves, o, ht


def grads_of(leaves, o, ht, do, dht):
    import torch

    ins = [t for t in leaves.values() if t is not None]
    outs, gouts = [o], [do.to(o.dtype)]
    if ht is not None and dht is not None:
        outs.append(ht)
        gouts.append(dht.to(ht.dtype))
    gs = torch.autograd.grad(outs, ins, gouts)
    return dict(zip([n for n, t in leaves.items() if t is not None], gs))


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------

def check(op, label, B, T, H, HV, K, V, gates, policies, v_first=False, cu_lens=None, seed=0):
    import torch

    from rewy_hf.rel_error import rel_err

    scale = K ** -0.5
    cu = None
    N = None
    if cu_lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(cu_lens).cumsum(0).tolist()), device=DEVICE, dtype=torch.long)
        N, T, B = len(cu_lens), sum(cu_lens), 1
    x, do, dht = make_inputs(op, B, T, H, HV, K, V, gates, seed, N=N, v_first=v_first)
    safe = gates == "bound"
    ref = grads_of(*run_impl("ref", op, x, "full", scale, v_first=v_first, cu=cu, fp32=True), do, dht)
    all_ok = True
    for policy in policies:
        fla = grads_of(*run_impl("fla", op, x, policy, scale, safe, v_first, cu), do, dht)
        ours = grads_of(*run_impl("ours", op, x, policy, scale, safe, v_first, cu), do, dht)
        cells, ok = [], True
        for n in ref:
            ef, eo = rel_err(fla[n], ref[n]), rel_err(ours[n], ref[n])
            bad = not (eo <= 1.1 * ef + 1e-6)     # NaN fails
            ok &= not bad
            cells.append(f"{n} {eo:.2e}/{ef:.2e}{' !' if bad else ''}")
        all_ok &= ok
        log(f"  {op:4s} {label:<26s} {policy:<9s} {'ok   ' if ok else 'WORSE'} | " + "  ".join(cells))
        del fla, ours
    torch.cuda.empty_cache()
    return all_ok


def bench(op, B, T, H, K, V, policies, rows, mem):
    import torch
    import triton

    x, do, _ = make_inputs(op, B, T, H, H, K, V, "logsigmoid", seed=1, with_state=False)
    scale = K ** -0.5
    for policy in policies:
        for impl in ("fla", "ours"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            leaves, o, _ = run_impl(impl, op, x, policy, scale)
            ins = [t for t in leaves.values() if t is not None]
            torch.autograd.grad(o, ins, do, retain_graph=True)        # warm-up / autotune, and peak memory
            torch.cuda.synchronize()
            mem[(op, B, T, H, policy, impl)] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            ms = triton.testing.do_bench(lambda o=o, ins=ins: torch.autograd.grad(o, ins, do, retain_graph=True),
                                         warmup=25, rep=100, return_mode="median")
            rows[(op, B, T, H, policy, impl)] = ms
            del leaves, o, ins
            torch.cuda.empty_cache()
        f, r = rows[(op, B, T, H, policy, "fla")], rows[(op, B, T, H, policy, "ours")]
        mf, mr = mem[(op, B, T, H, policy, "fla")], mem[(op, B, T, H, policy, "ours")]
        log(f"  {op:4s} ({B},{T},{H}) {policy:<9s} FLA {f:7.3f} ms  ours {r:7.3f} ms  x{f / r:5.2f}   "
            f"peak GiB FLA {mf:6.2f} ours {mr:6.2f}   [{elapsed():.0f}s]")


def profile(op, B, T, H, K, V, policy, impls=("fla", "ours")):
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    x, do, _ = make_inputs(op, B, T, H, H, K, V, "logsigmoid", seed=2, with_state=False)
    for impl in impls:
        leaves, o, _ = run_impl(impl, op, x, policy, K ** -0.5)
        ins = [t for t in leaves.values() if t is not None]
        torch.autograd.grad(o, ins, do, retain_graph=True)
        torch.cuda.synchronize()
        reps = 5
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                torch.autograd.grad(o, ins, do, retain_graph=True)
            torch.cuda.synchronize()
        stats = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0)
            if t > 0:
                stats.append((t / reps / 1000.0, e.key))
        stats.sort(reverse=True)
        total = sum(t for t, _ in stats)
        log(f"  {op} {impl} ({B},{T},{H}) {policy}: per-kernel ms per backward (sum {total:.3f})")
        for t, name in stats[:10]:
            log(f"    {t:7.3f}  {name[:100]}")
        del leaves, o, ins
        torch.cuda.empty_cache()


def main() -> int:
    global LOG
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="kda,gdn2")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget", type=float, default=240.0, help="seconds; later sections are skipped past it")
    p.add_argument("--no-extras", action="store_true", help="skip the GVA / state_v_first / cu_seqlens checks")
    p.add_argument("--sections", default="check,bench,profile,extras",
                   help="comma list of check, bench, profile, extras (rewy-hf bench now covers check and bench)")
    p.add_argument("--profile-shapes", nargs="+", default=["2,8192,16"], metavar="B,T,H",
                   help="shapes of the per-kernel profile (default 2,8192,16)")
    p.add_argument("--profile-impls", default="fla,ours",
                   help="fla, ours or both: FLA's first calls at a new shape autotune for minutes")
    p.add_argument("--intra-precision", default=None, choices=["tf32", "tf32x3", "ieee", "bf16"],
                   help="input precision of rewy's fp32 Matrix Intra products (default: the module's, tf32)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    LOG = open(os.path.join(a.out, "kda_gpu_check.log"), "w")
    warnings.filterwarnings("ignore")

    import torch
    import triton

    import fla

    torch.backends.cuda.matmul.allow_tf32 = False       # the fp32 reference is true fp32
    torch.backends.cudnn.allow_tf32 = False
    log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"fla {getattr(fla, '__version__', '?')}  python {sys.version.split()[0]}")
    from rewy_hf.bench_output import geomean
    from rewy_hf.kernels import triton_kda_bwd

    if a.intra_precision:
        triton_kda_bwd.INTRA_PRECISION = a.intra_precision
    log(f"rewy: stage-2 block width {triton_kda_bwd.INTRA_BLOCK_K}, SPAN_LIMIT {triton_kda_bwd.SPAN_LIMIT} (log2), "
        f"precision: intra off-diagonal "
        f"{triton_kda_bwd.INTRA_PRECISION}, diagonal {triton_kda_bwd.DIAG_PRECISION}, WY {triton_kda_bwd.WY_PRECISION}")
    ops = [o for o in a.ops.split(",") if o]
    wanted = set(a.sections.split(","))
    policies = ["recompute", "full"]
    K = V = 128
    status = {}
    rows, mem = {}, {}

    def section(name, budget_frac=1.0):
        if elapsed() > a.budget * budget_frac:
            log(f"-- {name}: skipped (time {elapsed():.0f}s > {a.budget * budget_frac:.0f}s)")
            return False
        log(f"-- {name}  [{elapsed():.0f}s]")
        return True

    for op in ops:
        if "check" in wanted and section(f"{op}: gradient check, relative error vs fp32 reference, ours/FLA per "
                                         "gradient", 0.55):
            try:
                ok = check(op, "T=1000 logsigmoid", 2, 1000, 16, 16, K, V, "logsigmoid", policies)
                ok &= check(op, "T=1000 bound(-5) safe_gate", 2, 1000, 16, 16, K, V, "bound", policies, seed=3)
                status[f"{op} check"] = "ok" if ok else "WORSE"
            except Exception as e:                                   # keep going: timing still informative
                status[f"{op} check"] = f"ERROR {type(e).__name__}: {e}"
                log(f"  ERROR {type(e).__name__}: {e}")
        if "bench" in wanted and section(f"{op}: backward time (median), FLA vs ours", 0.8):
            try:
                bench(op, 2, 8192, 16, K, V, policies, rows, mem)
                if elapsed() < 0.85 * a.budget:
                    bench(op, 1, 32768, 32, K, V, policies, rows, mem)
                else:
                    log("  (1,32768,32): skipped (time)")
            except Exception as e:
                status[f"{op} bench"] = f"ERROR {type(e).__name__}: {e}"
                log(f"  ERROR {type(e).__name__}: {e}")
    for op in ops:
        if "profile" in wanted and section(f"{op}: per-kernel profile of one backward (full policy)", 0.9):
            try:
                for shape in a.profile_shapes:
                    B_, T_, H_ = (int(v_) for v_ in shape.split(","))
                    profile(op, B_, T_, H_, K, V, "full", impls=tuple(a.profile_impls.split(",")))
            except Exception as e:
                log(f"  profile failed: {type(e).__name__}: {e}")
    if "extras" in wanted and not a.no_extras and section("extras: GVA, state_v_first, cu_seqlens (full policy)", 0.9):
        try:
            ok = check("kda", "GVA H=8 HV=16", 2, 1000, 8, 16, K, V, "logsigmoid", ["full"], seed=4)
            ok &= check("kda", "state_v_first", 2, 1000, 16, 16, K, V, "logsigmoid", ["full"], v_first=True, seed=5)
            ok &= check("kda", "cu_seqlens 300+1000+77", 1, 0, 16, 16, K, V, "logsigmoid", ["full"],
                        cu_lens=[300, 1000, 77], seed=6)
            if "gdn2" in ops:
                ok &= check("gdn2", "cu_seqlens+state_v_first", 1, 0, 16, 16, K, V, "logsigmoid", ["full"],
                            v_first=True, cu_lens=[300, 1000, 77], seed=7)
            status["extras check"] = "ok" if ok else "WORSE"
        except Exception as e:
            status["extras check"] = f"ERROR {type(e).__name__}: {e}"
            log(f"  ERROR {type(e).__name__}: {e}")

    log("== summary")
    for k_, v_ in status.items():
        log(f"  {k_}: {v_}")
    if rows:
        log("  backward ms (median), bf16, K=V=128, log-sigmoid gates, no initial state")
        log(f"  {'op':4s} {'shape':>14s} {'policy':9s} {'FLA':>8s} {'ours':>8s} {'speedup':>8s} "
            f"{'GiB FLA':>8s} {'ours':>6s}")
        for (op, B, T, H, policy, impl), ms in rows.items():
            if impl != "fla" or (op, B, T, H, policy, "ours") not in rows:
                continue
            r = rows[(op, B, T, H, policy, "ours")]
            log(f"  {op:4s} {f'({B},{T},{H})':>14s} {policy:9s} {ms:8.3f} {r:8.3f} {ms / r:8.2f} "
                f"{mem[(op, B, T, H, policy, 'fla')]:8.2f} {mem[(op, B, T, H, policy, 'ours')]:6.2f}")
        for op in ops:
            for policy in policies:
                sp = [rows[k_] / rows[k_[:-1] + ("ours",)] for k_ in rows
                      if k_[0] == op and k_[4] == policy and k_[5] == "fla" and k_[:-1] + ("ours",) in rows]
                if sp:
                    log(f"  {op} {policy}: geometric-mean speedup {geomean(sp):.2f}"
                        f" over {len(sp)} shape(s)")
    for kern in ("rewy_kda_bwd_wy_kernel", "rewy_kda_bwd_intra_kernel"):
        tuner = getattr(triton_kda_bwd, kern)
        log(f"  {kern} last best config: {getattr(tuner, 'best_config', None)}")
        # every autotune key seen in this process and its pick (the key includes the size class)
        for key_, cfg in getattr(tuner, "cache", {}).items():
            log(f"    key {key_}: {cfg}")
    # FLA's reverse state recurrence, which both sides run: its pick varies between processes
    from rewy_hf.autotune_picks import autotuners

    for tuner in autotuners(("fla.ops.common.chunk_delta_h",)):
        name_ = tuner.fn.__name__
        if name_.startswith("chunk_gated_delta_rule_bwd_kernel"):
            for key_, cfg in tuner.cache.items():
                log(f"  FLA {name_} key {key_}: {cfg}")
    log(f"total {elapsed():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
