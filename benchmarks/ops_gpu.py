"""FLA 0.6.0 vs rewy on the GPU, op level: correctness first, then time.

For each op and shape: BF16 inputs (K = V = 128 by default), log-sigmoid gates,
l2-normalised keys. Correctness: the gradients of FLA and of rewy (both on the
BF16 inputs) against an fp32 reference (rewy's torch backend on the same inputs
cast to float32); rewy's error must not exceed FLA's by more than 10 %. Time:
``triton.testing.do_bench`` medians of FLA and rewy alternately, for the
boundaries B (backward only) and FB (forward + backward), plus peak memory of
one forward + backward.

FLA's GDN backward refuses to run on Hopper with triton < 3.7.1 (FLA issue
#640); ``--lift-gdn-guard`` lifts that guard so its time can be measured. Such a
baseline is timing-only: its gradients are not trusted and not compared.

Usage: python benchmarks/ops_gpu.py --ops gdn kda --shapes 0 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

SHAPES = json.loads((pathlib.Path(__file__).parent / "bench_shapes.json").read_text())["shapes"]


def make_inputs(op: str, B: int, T: int, H: int, K: int, V: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    if op == "delta_rule":
        extra = [torch.rand(B, T, H, device="cuda", generator=gen)]
    elif op == "gdn":
        extra = [F.logsigmoid(r(B, T, H)), torch.rand(B, T, H, device="cuda", generator=gen)]
    elif op == "kda":
        extra = [F.logsigmoid(r(B, T, H, K)), torch.rand(B, T, H, device="cuda", generator=gen)]
    else:
        extra = [F.logsigmoid(r(B, T, H, K)), torch.rand(B, T, H, K, device="cuda", generator=gen),
                 torch.rand(B, T, H, V, device="cuda", generator=gen)]
    return [q, k, v, *extra]


def fla_op(op: str):
    if op == "delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule as f
    elif op == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
    elif op == "kda":
        from fla.ops.kda import chunk_kda as f
    else:
        from fla.ops.gdn2 import chunk_gdn2 as f
    return f


def rewy_op(op: str, backend: str, policy: str):
    import rewy_hf

    f = {"delta_rule": rewy_hf.chunk_delta_rule, "gdn": rewy_hf.chunk_gated_delta_rule,
         "kda": rewy_hf.chunk_kda, "gdn2": rewy_hf.chunk_gdn2}[op]
    return lambda *a, **k: f(*a, backend=backend, policy=policy, **k)


def grads_of(fn, inputs, do):
    leaves = [x.detach().requires_grad_() for x in inputs]
    o, _ = fn(*leaves)
    return [g.float() for g in torch.autograd.grad(o, leaves, do)]


def rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def bench(fn, inputs, do, boundary: str) -> float:
    import triton

    leaves = [x.detach().requires_grad_() for x in inputs]
    if boundary == "FB":
        def run():
            o, _ = fn(*leaves)
            torch.autograd.grad(o, leaves, do)
    else:
        def run():
            torch.autograd.grad(o, leaves, do, retain_graph=True)
        o, _ = fn(*leaves)
    return triton.testing.do_bench(run, warmup=5, rep=30, return_mode="median")


def peak_mb(fn, inputs, do) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    leaves = [x.detach().requires_grad_() for x in inputs]
    o, _ = fn(*leaves)
    torch.autograd.grad(o, leaves, do)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=["gdn", "kda", "gdn2", "delta_rule"])
    p.add_argument("--shapes", nargs="+", type=int, default=list(range(len(SHAPES))), help="indices into the suite")
    p.add_argument("--backend", default="auto")
    p.add_argument("--policy", default="recompute")
    p.add_argument("--check-shape", default="1,2048,8", help="B,T,H for the correctness check")
    p.add_argument("--lift-gdn-guard", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    K = V = 128
    if args.lift_gdn_guard:
        import fla.ops.common.chunk_o as chunk_o
        chunk_o.TRITON_ABOVE_3_7_1 = True
    rows = []
    for op in args.ops:
        fla, ours = fla_op(op), rewy_op(op, args.backend, args.policy)
        B, T, H = map(int, args.check_shape.split(","))
        x32 = make_inputs(op, B, T, H, K, V)
        xb = [x.bfloat16() if i < 3 else x for i, x in enumerate(x32)]
        do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
        ref = grads_of(rewy_op(op, "torch", "full"), [x.float() for x in xb], do.float())
        g_ours = grads_of(ours, xb, do)
        err_ours = max(rel(a, r) for a, r in zip(g_ours, ref))
        trusted = not (op == "gdn" and args.lift_gdn_guard)
        err_fla = None
        if trusted:
            try:
                err_fla = max(rel(a, r) for a, r in zip(grads_of(fla, xb, do), ref))
            except Exception as exc:  # FLA refusing to run is itself a finding
                print(f"[{op}] FLA backward did not run: {exc}", file=sys.stderr)
        ok = err_ours <= max(1.1 * err_fla, 1e-6) if err_fla is not None else err_ours < 1e-2
        print(f"[{op}] check at B,T,H={B},{T},{H}: rewy err {err_ours:.3e}, FLA err "
              f"{'n/a' if err_fla is None else f'{err_fla:.3e}'} -> {'OK' if ok else 'FAIL'}", flush=True)
        for i in args.shapes:
            s = SHAPES[i]
            x = [t.bfloat16() if j < 3 else t for j, t in enumerate(make_inputs(op, s["B"], s["T"], s["H"], K, V))]
            dout = torch.randn(s["B"], s["T"], s["H"], V, device="cuda", dtype=torch.bfloat16)
            row = {"op": op, **s, "err_rewy": err_ours, "err_fla": err_fla, "ok": ok}
            for boundary in ("B", "FB"):
                row[f"fla_{boundary}_ms"] = bench(fla, x, dout, boundary)
                row[f"rewy_{boundary}_ms"] = bench(ours, x, dout, boundary)
            row["fla_peak_mb"], row["rewy_peak_mb"] = peak_mb(fla, x, dout), peak_mb(ours, x, dout)
            rows.append(row)
            print(f"[{op}] B={s['B']} T={s['T']} H={s['H']}: backward FLA {row['fla_B_ms']:.2f} ms, "
                  f"rewy {row['rewy_B_ms']:.2f} ms ({row['fla_B_ms'] / row['rewy_B_ms']:.2f}x); "
                  f"fwd+bwd {row['fla_FB_ms']:.2f} / {row['rewy_FB_ms']:.2f} ms; peak MB "
                  f"{row['fla_peak_mb']:.0f} / {row['rewy_peak_mb']:.0f}", flush=True)
            del x, dout
            torch.cuda.empty_cache()
    for op in args.ops:
        r = [x for x in rows if x["op"] == op]
        if r:
            gm = math.exp(sum(math.log(x["fla_B_ms"] / x["rewy_B_ms"]) for x in r) / len(r))
            print(f"[{op}] geometric-mean backward speedup (FLA / rewy): {gm:.3f}x over {len(r)} shapes")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
