"""Which contractions of the KDA / GDN2 Triton backward need more than tf32 / bf16.

For each op, on the bench's inputs (BF16, log-sigmoid gates) at one shape,
prints the per-gradient relative error against the fp32 torch backend for
FLA 0.6.0 and for rewy's Triton backward under each setting of
``INTRA_PRECISION`` (the off-diagonal Matrix Intra products),
``DIAG_PRECISION`` (the diagonal Matrix Intra blocks) and ``WY_PRECISION``
(the two Residual WY products with an fp32 partial), with the backward time
of each. Autotuning is cut to each kernel's first config so the settings
compile quickly; the times compare settings, not the tuned kernel.

Writes ``--choice`` (a shell file exporting REWY_KDA_INTRA_PRECISION,
REWY_KDA_DIAG_PRECISION and REWY_KDA_WY_PRECISION): the fastest setting whose every gradient error is
within 1.1 x FLA's error of the same gradient (+1e-5) for every op, or the
most accurate one when none is.

    source tools/h200_env.sh && python3 benchmarks/kda_precision.py --choice $OUT/kda_choice.env
"""

from __future__ import annotations

import argparse

# (off-diagonal intra, diagonal intra, WY); the shipped default first
SETTINGS = [("tf32", "tf32x3", "bf16"), ("bf16", "tf32x3", "bf16"), ("bf16", "tf32", "bf16"),
            ("tf32", "tf32", "bf16"), ("tf32x3", "tf32x3", "tf32")]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--ops", nargs="+", default=["kda", "gdn2"])
    p.add_argument("--choice", default=None)
    a = p.parse_args()

    import torch
    import triton.testing

    from rewy_hf.bench_config import Shape
    from rewy_hf.bench_ops import GRAD_NAMES, fla_impl, grads, make_inputs, reference_grads, rel_err, rewy_impl
    from rewy_hf.bench_timing import runner
    from rewy_hf.kernels import triton_kda_bwd as tk

    for kern in (tk.rewy_kda_bwd_wy_kernel, tk.rewy_kda_bwd_intra_kernel):
        kern.configs = kern.configs[:1]
    shape = Shape(a.B, a.T, a.H, 128, 128)
    verdict = {s: True for s in SETTINGS}
    worst = {s: 0.0 for s in SETTINGS}
    ms = {s: 0.0 for s in SETTINGS}
    for op in a.ops:
        x, do = make_inputs(op, shape, "cuda", torch.bfloat16, 0)
        ref = reference_grads(op, x, do, "cuda")
        names = GRAD_NAMES[op]
        fla = fla_impl(op, "recompute", {})
        e_fla = {n: rel_err(g, r) for n, g, r in zip(names, grads(fla.fn, x, do), ref)}
        t_fla = triton.testing.do_bench(runner("B", fla.fn, x, do), rep=200, return_mode="median")
        print(f"{op} {shape.label}  FLA      " + "  ".join(f"{n} {e:.2e}" for n, e in e_fla.items())
              + f"  | B {t_fla:.3f} ms", flush=True)
        for s in SETTINGS:
            tk.INTRA_PRECISION, tk.DIAG_PRECISION, tk.WY_PRECISION = s
            rw = rewy_impl(op, "triton", "recompute")
            e = {n: rel_err(g, r) for n, g, r in zip(names, grads(rw.fn, x, do), ref)}
            t = triton.testing.do_bench(runner("B", rw.fn, x, do), rep=200, return_mode="median")
            ok = all(e[n] <= 1.1 * e_fla[n] + 1e-5 for n in names)
            verdict[s] &= ok
            worst[s] = max(worst[s], max(e[n] / e_fla[n] for n in names))
            ms[s] += t
            print(f"{op} {shape.label}  intra={s[0]:<6} diag={s[1]:<6} wy={s[2]:<6} "
                  + "  ".join(f"{n} {e[n]:.2e}" for n in names)
                  + f"  | B {t:.3f} ms ({t_fla / t:.2f}x)  per-grad <= 1.1 FLA: {ok}", flush=True)
        del x, do, ref
        torch.cuda.empty_cache()
    passing = [s for s in SETTINGS if verdict[s]]
    pick = min(passing, key=lambda s: ms[s]) if passing else min(SETTINGS, key=lambda s: worst[s])
    print(f"choice: intra={pick[0]} diag={pick[1]} wy={pick[2]} ({'passes' if passing else 'none passes; most accurate'}; "
          f"worst ratio to FLA {worst[pick]:.3f})", flush=True)
    if a.choice:
        with open(a.choice, "w") as f:
            f.write(f"export REWY_KDA_INTRA_PRECISION={pick[0]} REWY_KDA_DIAG_PRECISION={pick[1]} "
                    f"REWY_KDA_WY_PRECISION={pick[2]}\n")
    return 0 if passing else 1


if __name__ == "__main__":
    raise SystemExit(main())
