"""The recompute policy's state rebuild from checkpoints (kernels/state_checkpoints.py)
against the sequential rebuild it replaces, on the GPU.

For each shape: the shipped sequential launch of FLA's ``fwd_h``
(kernels/state_launch.py), then the rebuild from checkpoints at each segment
length L (chunks per segment; ``auto`` = what the backward picks). Both get the
same inputs; the checkpoints are the sequential run's h. Prints the largest
relative difference from the sequential h / v_new, the median times and the
speed-up, one row per (shape, L).

    python3 -P benchmarks/checkpoint_timing.py --shapes 2,8192,16 1,16384,16 --lengths auto 8 16 32
"""

from __future__ import annotations

import argparse

import torch
import triton


def main() -> None:
    from state_scan_timing import inputs, shape_arg     # this folder is on sys.path when the script runs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", type=shape_arg,
                   default=[(8, 2048, 16), (4, 4096, 16), (2, 8192, 16), (1, 16384, 16), (4, 4096, 32),
                            (1, 32768, 32)])
    p.add_argument("--lengths", nargs="+", default=["auto", "4", "8", "16", "32"],
                   help="chunks per segment; auto = what state_checkpoints.chunks_per_segment picks")
    p.add_argument("--gate", choices=["gdn", "kda", "none"], default="gdn",
                   help="GDN's scalar gate, per-key gates with k pre-gated (KDA, GDN2), or none (DeltaNet)")
    args = p.parse_args()
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    from rewy_hf.kernels import state_checkpoints as C
    from rewy_hf.kernels import state_launch
    from rewy_hf.rel_error import rel_err

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fwd_h = lambda **kw: state_launch.fwd_h(chunk_gated_delta_rule_fwd_h, chunk_size=64, **kw)    # noqa: E731
    rows = []
    for B, T, H in args.shapes:
        x = inputs("kda" if args.gate == "kda" else "gdn", B, T, H)
        gates = dict(g=x["g"] if args.gate == "gdn" else None, gk=x["gk"])
        seq = lambda: fwd_h(k=x["k"], w=x["w"], u=x["u"], initial_state=None, **gates)    # noqa: E731
        h, v_new, _ = seq()
        t_seq = triton.testing.do_bench(seq, return_mode="median")
        NT = triton.cdiv(T, 64)
        auto = C.chunks_per_segment([NT] * B, H, 128, sms)
        lengths = sorted({auto if s == "auto" else int(s) for s in args.lengths} - {None})
        for L in lengths:
            seg = C._segments(tuple(range(0, B * T + 1, T)), L, torch.device("cuda"))
            states = C.save(h, None, seg)
            run = lambda: C.rebuild(chunk_gated_delta_rule_fwd_h, states, seg, x["u"],    # noqa: E731
                                    k=x["k"], w=x["w"], **gates)
            h2, v_new2 = run()
            err = max(rel_err(h2, h), rel_err(v_new2, v_new))
            t = triton.testing.do_bench(run, return_mode="median")
            rows.append((f"{B},{T},{H}", L, "auto" if L == auto else "", seg.count, err, t_seq, t))
            print(f"{B},{T},{H} L={L}: {seg.count} segments, err {err:.1e}, sequential {t_seq:.3f} ms, "
                  f"from checkpoints {t:.3f} ms", flush=True)
    print()
    print(f"gate {args.gate}")
    print(f"{'B,T,H':12} {'L':>3} {'':4} {'segments':>8} {'max rel err':>11} {'sequential':>10} {'checkpoints':>11} "
          f"{'speed-up':>8}")
    for shape, L, tag, count, err, t_seq, t in rows:
        print(f"{shape:12} {L:>3} {tag:4} {count:>8} {err:11.1e} {t_seq:10.3f} {t:11.3f} {t_seq / t:7.2f}x")
    worst = max(r[4] for r in rows)
    print(f"largest relative difference from the sequential rebuild: {worst:.1e} "
          f"({'PASS' if worst <= 1e-2 else 'FAIL'}, limit 1e-2)")
    raise SystemExit(0 if worst <= 1e-2 else 1)


if __name__ == "__main__":
    main()
