"""The sequence-parallel state recurrences (kernels/triton_state_scan.py) against
FLA's sequential ``chunk_gated_delta_rule_fwd_h`` / ``..._bwd_dhu`` on the GPU.

For each gate form (``gdn``: one gate per token; ``kda``: per-key gates with q
and k pre-gated, as KDA and GDN2 pass them), each shape and each segment
count: the largest relative difference from FLA's outputs, the median time of
both sides, and the device time of each phase (first pass, scan, final pass)
from one profiled call. Prints one table per direction.

    python3 -P benchmarks/state_scan_timing.py --shapes 1,16384,16 2,8192,16 --segments auto 4 8 16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton


def shape_arg(text: str) -> tuple[int, int, int]:
    """argparse type of a B,T,H shape (also timing_gaps.py's)."""
    B, T, H = (int(x) for x in text.split(","))
    return B, T, H


def inputs(kind: str, B: int, T: int, H: int, K: int = 128, V: int = 128, seed: int = 0) -> dict:
    from fla.ops.utils import chunk_local_cumsum

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)    # noqa: E731
    gate_shape = (B, T, H, K) if kind == "kda" else (B, T, H)
    g = chunk_local_cumsum(F.logsigmoid(r(*gate_shape) + 4), chunk_size=64, scale=1.4426950408889634)
    return dict(k=(F.normalize(r(B, T, H, K), dim=-1) * 0.5).bfloat16(), q=r(B, T, H, K).bfloat16(),
                w=(0.1 * r(B, T, H, K)).bfloat16(), u=r(B, T, H, V).bfloat16(), do=r(B, T, H, V).bfloat16(),
                dv=r(B, T, H, V).bfloat16(), h0=0.3 * r(B, H, K, V), dht=0.3 * r(B, H, K, V),
                g=None if kind == "kda" else g, gk=g if kind == "kda" else None, scale=K ** -0.5)


def sides(x: dict, ns: int):
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h

    from rewy_hf.kernels.triton_state_scan import state_backward, state_forward

    def fwd_fla():
        return chunk_gated_delta_rule_fwd_h(k=x["k"], w=x["w"], u=x["u"], g=x["g"], gk=x["gk"],
                                            initial_state=x["h0"], output_final_state=True, chunk_size=64)

    def fwd_rewy():
        return state_forward(x["k"], x["w"], x["u"], x["g"], x["h0"], NS=ns, gk=x["gk"])

    def bwd_fla():
        return chunk_gated_delta_rule_bwd_dhu(q=x["q"], k=x["k"], w=x["w"], do=x["do"], dv=x["dv"], g=x["g"],
                                              gk=x["gk"], h0=x["h0"], dht=x["dht"], scale=x["scale"], chunk_size=64)

    def bwd_rewy():
        return state_backward(x["q"], x["k"], x["w"], x["do"], x["dv"], x["g"], x["dht"], x["scale"], NS=ns,
                              gk=x["gk"])

    return dict(forward=(fwd_fla, fwd_rewy), backward=(bwd_fla, bwd_rewy))


def phase_times(fn) -> list[float]:
    """Device ms of each kernel one call launches, in launch order."""
    from gdn_bwd_stages import kernel_times     # this folder is on sys.path when the script runs

    return [ms for _, ms in kernel_times(fn)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["kda", "gdn"], choices=["kda", "gdn"])
    p.add_argument("--shapes", nargs="+", type=shape_arg, default=[(1, 16384, 16), (2, 8192, 16), (1, 32768, 32)])
    p.add_argument("--segments", nargs="+", default=["auto", "4", "8", "16"],
                   help="segment counts to time; auto = the count triton_state_scan.segments_for picks")
    args = p.parse_args()
    from rewy_hf.kernels.triton_state_scan import segments_for
    from rewy_hf.rel_error import rel_err

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for kind in args.kinds:
        for B, T, H in args.shapes:
            x = inputs(kind, B, T, H)
            auto = segments_for(B, H, T, 128, sms)
            counts = sorted({auto if s == "auto" else int(s) for s in args.segments} - {1})
            for ns in counts:
                for direction, (fla, rewy) in sides(x, ns).items():
                    ref, out = fla(), rewy()
                    err = max(rel_err(a, b) for a, b in zip(out, ref))
                    t_fla = triton.testing.do_bench(fla, return_mode="median")
                    t_rewy = triton.testing.do_bench(rewy, return_mode="median")
                    phases = phase_times(rewy)
                    rows.append((kind, f"{B},{T},{H}", direction, ns, "auto" if ns == auto else "", err, t_fla, t_rewy,
                                 phases))
                    print(f"{kind} {B},{T},{H} {direction} NS={ns}: err {err:.1e}, FLA {t_fla:.3f} ms, "
                          f"rewy {t_rewy:.3f} ms, phases {' + '.join(f'{t:.3f}' for t in phases)}", flush=True)
    print()
    print(f"{'gate':5} {'B,T,H':12} {'direction':9} {'NS':>3} {'':4} {'max rel err':>11} {'FLA ms':>7} "
          f"{'rewy ms':>7} {'FLA/rewy':>8}  phases (first pass + scan + final pass, ms)")
    for kind, shape, direction, ns, tag, err, t_fla, t_rewy, phases in rows:
        print(f"{kind:5} {shape:12} {direction:9} {ns:>3} {tag:4} {err:11.1e} {t_fla:7.3f} {t_rewy:7.3f} "
              f"{t_fla / t_rewy:7.2f}x  {' + '.join(f'{t:.3f}' for t in phases)}")
    worst = max(r[5] for r in rows)
    print(f"largest relative difference from FLA: {worst:.1e} ({'PASS' if worst <= 1e-2 else 'FAIL'}, limit 1e-2)")
    raise SystemExit(0 if worst <= 1e-2 else 1)


if __name__ == "__main__":
    main()
