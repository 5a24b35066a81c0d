"""Stage 2 of the KDA/GDN2 backward alone, at several key-block widths, same
inputs, on the GPU: how ``INTRA_BLOCK_K`` (triton_kda_bwd.py) was chosen.

Inputs are what the stage receives in a real backward, at one shape: BF16 q and
(normalised) k, log-sigmoid gates as FLA stores them (chunk-local cumulative
sums in log2 units), the erase gate, a causal dAqk and strictly lower dL, and
float32 partials. Every width must agree with the first (relative difference
printed; the script exits non-zero above 1e-3: the widths do the same
products, split differently), then each is timed with triton.testing.do_bench
(median, autotuned first). The outputs are new buffers (inplace=False), so
every timed call sees the same partials.

A whole-chunk variant of this kernel was compared the same way on the H200
(2026-11-30) and lost: 1.83 / 2.75 ms against 1.57 / 1.69 ms at widths
32 / 64 for KDA at (2, 8192, 16, 128).

Usage: python benchmarks/kda_intra_widths.py --B 2 --T 8192 --H 16 [--op gdn2] [--block-k 64 32 16]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton


def inputs(op: str, B: int, T: int, H: int, K: int, slots: int, seed: int = 0) -> dict:
    """``slots``: KDA's erase-gate partial slots from stage 1."""
    from fla.ops.utils import chunk_local_cumsum

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)    # noqa: E731
    BT = 64
    q = r(B, T, H, K).bfloat16()
    k = F.normalize(r(B, T, H, K), dim=-1).bfloat16()
    g = chunk_local_cumsum(F.logsigmoid(r(B, T, H, K)), chunk_size=BT, scale=1.4426950408889634)
    beta = torch.rand(B, T, H, K, device="cuda", generator=gen).bfloat16() if op == "gdn2" else \
        torch.rand(B, T, H, device="cuda", generator=gen)
    causal = torch.ones(BT, BT, device="cuda").tril()
    # [B, T, H, BT]: the chunk's row i at its token, column j in the last dim
    dAqk = (0.1 * r(B, T // BT, BT, H, BT) * causal[None, None, :, None, :]).reshape(B, T, H, BT)
    dL = (0.1 * r(B, T // BT, BT, H, BT) * causal.tril(-1)[None, None, :, None, :]).reshape(B, T, H, BT)
    dq, dk, dG = (r(B, T, H, K) for _ in range(3))
    db = r(B, T, H, K) if op == "gdn2" else r(B, T, H, slots)
    return dict(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dL=dL, dq=dq, dk=dk, dG=dG, db_part=db)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["kda", "gdn2"], default="kda")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--block-k", type=int, nargs="+", default=[64, 32, 16], help="key channels per program")
    a = p.parse_args()
    if a.T % 64:
        p.error("--T must be a multiple of 64")

    from rewy_hf.kernels.triton_kda_bwd import rewy_kda_bwd_intra

    x = inputs(a.op, a.B, a.T, a.H, a.K, slots=3)
    run = {bk: (lambda bk=bk: rewy_kda_bwd_intra(**x, inplace=False, block_k=bk)) for bk in a.block_k}
    outs = {bk: fn() for bk, fn in run.items()}
    first = a.block_k[0]
    worst = 0.0
    for bk in a.block_k[1:]:
        for name, o_r, o_b in zip(("dq", "dk", "dg", "db"), outs[first], outs[bk]):
            rel = ((o_b.float() - o_r.float()).norm() / o_r.float().norm()).item()
            worst = max(worst, rel)
            print(f"{name}: block_k {bk} vs {first} relative difference {rel:.2e}")
    print(f"{a.op} stage 2 at (B, T, H, K) = ({a.B}, {a.T}, {a.H}, {a.K}); {torch.cuda.get_device_name()}")
    for bk, fn in run.items():
        ms = triton.testing.do_bench(fn, return_mode="median")
        print(f"  block_k {bk:3d} {ms:8.3f} ms")
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
