"""CPU benchmark: rewy's torch backend vs. autograd through transformers' reference.

Both sides compute gated delta rule forward + backward on the same inputs:

* rewy:         ``rewy_hf.chunk_gated_delta_rule(..., backend="torch", policy=P)``
                (hand-written ReWY backward), for P in {"recompute", "full"};
* transformers: the pure-torch chunked path behind
                ``modeling_qwen3_5.torch_chunk_gated_delta_rule`` (its hub-kernel
                dispatch skipped), differentiated by autograd.

The transformers path takes [B, T, H, D] tensors like FLA and always scales q by
K ** -0.5 after the (optional) l2norm, so rewy is called with that same scale.
Outputs and the gradients of q, k, v, g, beta are checked against the
transformers path first (relative error ||x - ref|| / ||ref||; exit code 1 if
any exceeds --tol), then the sides are timed, alternating in one process.

    python $REPO/dev/cpu_backend.py [--T 2048] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

import rewy_hf
from rewy_hf.adapters.transformers_common import plain_torch
from rewy_hf.rel_error import rel_err

HF_REF = plain_torch(modeling_qwen3_5.torch_chunk_gated_delta_rule)
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def make_inputs(B, T, H, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H))  # log-decay <= 0
    beta = torch.sigmoid(r(B, T, H))
    do = r(B, T, H, V)  # upstream gradient of the output
    return (q, k, v, g, beta), do


def run_hf(inputs, do):
    xs = [x.detach().requires_grad_() for x in inputs]
    o, _ = HF_REF(*xs, chunk_size=64, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(o, xs, do)
    return (o.detach(), *grads)


def run_rewy(inputs, do, policy):
    xs = [x.detach().requires_grad_() for x in inputs]
    scale = inputs[0].shape[-1] ** -0.5  # what the transformers path uses
    o, _ = rewy_hf.chunk_gated_delta_rule(*xs, scale=scale, use_qk_l2norm_in_kernel=True,
                                          backend="torch", policy=policy)
    grads = torch.autograd.grad(o, xs, do)
    return (o.detach(), *grads)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions per side")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--tol", type=float, default=1e-4, help="max relative error (float32)")
    p.add_argument("--json", default=None, help="write the results to this path")
    a = p.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    inputs, do = make_inputs(a.B, a.T, a.H, a.K, a.V, torch.float32)
    sides = {
        "transformers": lambda: run_hf(inputs, do),
        "rewy[recompute]": lambda: run_rewy(inputs, do, "recompute"),
        "rewy[full]": lambda: run_rewy(inputs, do, "full"),
    }
    print(f"shape B={a.B} T={a.T} H={a.H} K={a.K} V={a.V} float32, l2norm-qk, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}")

    # 1. correctness: every rewy policy against the transformers path
    ref = sides["transformers"]()
    errors, ok = {}, True
    for name in ("rewy[recompute]", "rewy[full]"):
        out = sides[name]()
        errors[name] = {n: rel_err(x, r) for n, x, r in zip(NAMES, out, ref)}
        bad = [n for n, e in errors[name].items() if not e <= a.tol]
        ok &= not bad
        print(f"{name:16s} rel err vs transformers: "
              + "  ".join(f"{n}={e:.2e}" for n, e in errors[name].items())
              + ("" if not bad else f"   FAIL ({', '.join(bad)} > {a.tol:g})"))

    # 2. timing: warm-up, then alternate the sides rep by rep (fwd + bwd each)
    for _ in range(a.warmup):
        for fn in sides.values():
            fn()
    times = {name: [] for name in sides}
    for _ in range(a.reps):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    hf = med["transformers"]

    print(f"\nforward+backward, median of {a.reps} reps ({a.warmup} warm-up), ms:")
    print(f"{'side':16s} {'median':>9s} {'min':>9s} {'max':>9s} {'hf/side':>8s}")
    for name, ts in times.items():
        print(f"{name:16s} {med[name]:9.1f} {min(ts):9.1f} {max(ts):9.1f} {hf / med[name]:8.2f}x")
    print(f"ratio transformers/rewy: recompute {hf / med['rewy[recompute]']:.2f}x, "
          f"full {hf / med['rewy[full]']:.2f}x   (>1 means rewy is faster)")

    if a.json:
        result = {"shape": {k: getattr(a, k) for k in ("B", "T", "H", "K", "V")}, "dtype": "float32",
                  "threads": torch.get_num_threads(), "reps": a.reps, "warmup": a.warmup,
                  "median_ms": med, "times_ms": times, "rel_err": errors, "tol": a.tol, "ok": ok,
                  "ratio_hf_over_rewy": {p: hf / med[f"rewy[{p}]"] for p in ("recompute", "full")}}
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {a.json}")
    if not ok:
        print("FAILED: rewy does not match the transformers path", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
