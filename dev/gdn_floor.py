"""The floor of a GDN backward: FLOPs and bytes per kernel, against the H200's roofline and the kernel
times the bench measured.

Counts the matrix products and the global-memory traffic of each kernel of one GDN backward (K = V =
128, chunk C = 64, bf16 inputs), for rewy's Triton pipeline under both save policies, for FlashQLA
0.1.3's fused backward, and for a fused Residual WY backward built the way FlashQLA's is (a state
preparation pass, then one kernel that walks the chunks in reverse). The products are read from the
kernels' source (``kernels/triton_backend/scalar_gate/*.py``, FLA's ``chunk_fwd_h``, FlashQLA's
``hopper/fused_bwd.py`` and ``prepare_h.py``); the bytes are each kernel's unique reads and writes
(a tile read twice by one program counts once), so they are a lower bound on its traffic.

Joined with the kernel times in the kept profile files (``--kernel-profile`` runs), each kernel gets
its achieved TFLOP/s and GB/s and the share of the roofline it reaches.

    cd /tmp && python /work/main/dev/gdn_floor.py --json /work/main/docs/bench/floor/gdn-floor.json \
        --markdown floor.md
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
C, K, V = 64, 128, 128
# H200 SXM: dense bf16 tensor-core peak and HBM3e bandwidth (NVIDIA's data sheet).
PEAK_TFLOPS, PEAK_TBPS = 989.4, 4.8

# One matrix product per chunk and head, as its (m, n, k): 2 m n k FLOPs.
CKV, CCK, CCV, CCC = (C, V, K), (C, C, K), (C, C, V), (C, C, C)
TILE = {"qk": C * K * 2, "v": C * V * 2, "A": C * C * 2, "state": K * V * 2, "gate": C * 4}

# kernel -> (products, tiles read, tiles written), per chunk and head.
KERNELS = {
    # rewy: prestage (recompute only): S^T = K Q^T, w = A (beta e^G K), u = A (beta V), dv_local = S^T dO.
    "rewy_gdn_prestage_kernel": ([CCK, CCK, CCV, CCV], ["qk", "qk", "v", "v", "A", "gate", "gate"],
                                 ["qk", "v", "v"]),
    # FLA's forward state pass, rebuilt under recompute: v_new = u - w h, h += (k e^..)^T v_new.
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": ([CKV, CKV], ["qk", "qk", "v", "gate"], ["state", "v"]),
    # FLA's local dv under full (Aqk saved): dv_local = Aqk^T dO.
    "chunk_bwd_kernel_dv_local": ([CCK, CCV], ["qk", "qk", "v", "gate"], ["v"]),
    # rewy's reverse walk: dv2 = dv_local + k dh, dh = e^g dh + q^T dO - w^T dv2.
    "rewy_gdn_walk_kernel": ([CKV, CKV, CKV], ["qk", "qk", "qk", "v", "v", "gate"], ["state", "v"]),
    # rewy's local Residual WY kernel: A^T dVn, dO Vn^T, dY Vn^T, dY h^T, dO h^T, Vn dh^T, then
    # P2 k, P2^T q, P k, P^T k (Gram Elimination: no key Gram).
    "rewy_gdn_bwd_local_kernel": ([CCV, CCV, CCV, CKV, CKV, CKV, CCK, CCK, CCK, CCK],
                                  ["qk", "qk", "v", "v", "v", "v", "A", "state", "state", "gate", "gate"],
                                  ["qk", "qk", "v", "gate", "gate"]),
    # FlashQLA: X = A^T K, U = K S, S += X^T Y; writes every chunk's state.
    "tilelang_prepare_h_kernel_kernel": ([CCK, CKV, CKV], ["qk", "v", "A", "gate", "gate"], ["state"]),
    # FlashQLA's fused backward: 7 state-sized products, 10 chunk-square ones, and the textbook
    # WY backward dA = -A^T dA_r A^T (two C x C x C products) with the key Gram K K^T rebuilt.
    "tilelang_fused_chunk_gdr_bwd_kernel_kernel": (
        [CKV] * 7 + [CCK, CCV, CCV, CCV, CCK, CCK, CCV, CCV, CCK, CCK] + [CCC, CCC],
        ["qk", "qk", "v", "v", "A", "state", "gate", "gate"], ["qk", "qk", "v", "gate", "gate"]),
    # A fused Residual WY backward on FlashQLA's structure: after the same state preparation, one
    # kernel rebuilds w, u, v_new and dv_local on chip and runs the walk and the local kernel's products.
    "fused ReWY (design)": (
        [CCK, CCK, CCV, CCV] + [CKV] + [CKV] * 3 + [CCV, CCV, CCV, CKV, CKV, CKV, CCK, CCK, CCK, CCK],
        ["qk", "qk", "v", "v", "A", "state", "gate", "gate"], ["qk", "qk", "v", "gate", "gate"]),
}
PIPELINES = {
    "rewy recompute": ["rewy_gdn_prestage_kernel", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                       "rewy_gdn_walk_kernel", "rewy_gdn_bwd_local_kernel"],
    "rewy full": ["chunk_bwd_kernel_dv_local", "rewy_gdn_walk_kernel", "rewy_gdn_bwd_local_kernel"],
    "FlashQLA": ["tilelang_prepare_h_kernel_kernel", "tilelang_fused_chunk_gdr_bwd_kernel_kernel"],
    "fused ReWY (design)": ["tilelang_prepare_h_kernel_kernel", "fused ReWY (design)"],
}
DESIGN = "fused ReWY (design)"
# The shapes whose kernels the per-kernel table lists: one that fills the GPU with (batch, head) pairs,
# one long sequence, and the same tokens packed from eight sequences (FlashQLA's kernels only).
KERNEL_SHAPES = ((8, 2048, 16, 0), (1, 32768, 32, 0), (1, 32768, 32, 8))
# (kept profile file, the side whose kernels it holds, policy) -> measured kernel times.
PROFILES = (("docs/bench/walk/gdn-six-shapes.json", "rewy_kernels_B"),
            ("docs/bench/flashqla/gdn-auto-kernels.json", "baseline_kernels_B"),
            ("docs/bench/flashqla/gdn-auto-split.json", "baseline_kernels_B"))


def per_chunk(kernel: str) -> tuple[float, float]:
    """(FLOPs, bytes) of one chunk and head."""
    products, reads, writes = KERNELS[kernel]
    return sum(2 * m * n * k for m, n, k in products), sum(TILE[t] for t in reads + writes)


def chunk_heads(B: int, T: int, H: int, N: int) -> int:
    """Chunks times heads: a row packed from N equal sequences ends each in a chunk of its own."""
    if N:
        return H * N * math.ceil(T // N / C)
    return B * H * math.ceil(T / C)


def measured() -> dict:
    """(shape, policy) -> {kernel: ms} from the kept profiles; rewy's and FlashQLA's kernels by name."""
    out: dict = {}
    for path, side in PROFILES:
        for row in json.loads((ROOT / path).read_text())["rows"]:
            key = (row["B"], row["T"], row["H"], row.get("N") or 0)
            times = {name: k["ms"] for name, k in row.get(side, {}).items() if name in KERNELS}
            target = "FlashQLA" if "tilelang_fused_chunk_gdr_bwd_kernel_kernel" in times else f"rewy {row['policy']}"
            out.setdefault(key, {})[target] = times
    return out


def rows() -> list[dict]:
    table = []
    for (B, T, H, N), sides in sorted(measured().items()):
        n = chunk_heads(B, T, H, N)
        for pipeline, kernels in PIPELINES.items():
            times = sides.get(pipeline, sides.get("FlashQLA") if pipeline == "fused ReWY (design)" else None)
            for kernel in kernels:
                flops, nbytes = (x * n for x in per_chunk(kernel))
                floor_ms = max(flops / PEAK_TFLOPS / 1e9, nbytes / PEAK_TBPS / 1e9)
                ms = (times or {}).get(kernel) if kernel != "fused ReWY (design)" else None
                table.append(dict(B=B, T=T, H=H, N=N, pipeline=pipeline, kernel=kernel, gflop=flops / 1e9,
                                  mbytes=nbytes / 1e6, floor_ms=floor_ms, ms=ms,
                                  tflops=None if ms is None else flops / ms / 1e9,
                                  gbps=None if ms is None else nbytes / ms / 1e6,
                                  of_floor=None if ms is None else floor_ms / ms))
    return table


def whole_backward() -> dict:
    """(B, T, H, N) -> {pipeline: median ms of the whole backward} from the kept bench files: rewy's
    from the profiled run, FlashQLA's from its own run at every shape."""
    out: dict = {}
    for path, side, name in (("docs/bench/walk/gdn-six-shapes.json", "rewy_B_ms", "rewy {policy}"),
                             ("docs/bench/flashqla/gdn-flashqla.json", "baseline_B_ms", "FlashQLA"),
                             ("docs/bench/flashqla/gdn-flashqla-1_32768_32.json", "baseline_B_ms", "FlashQLA"),
                             ("docs/bench/flashqla/gdn-auto-split.json", "baseline_B_ms", "FlashQLA")):
        for row in json.loads((ROOT / path).read_text())["rows"]:
            key = (row["B"], row["T"], row["H"], row.get("N") or 0)
            label = name.format(policy=row["policy"])
            if label == "FlashQLA" and row["policy"] != "recompute":
                continue                            # FlashQLA has one mode; its recompute row is the one
            out.setdefault(key, {})[label] = row[side]
    return out


def summary(table: list[dict]) -> list[dict]:
    """Per shape and pipeline: the summed kernel floors against the whole backward's median."""
    whole, out = whole_backward(), []
    for key in sorted({(r["B"], r["T"], r["H"], r["N"]) for r in table}):
        for pipeline in PIPELINES:
            if pipeline == DESIGN:
                continue                             # its floor is FlashQLA's (same products, same tiles)
            part = [r for r in table if (r["B"], r["T"], r["H"], r["N"]) == key and r["pipeline"] == pipeline]
            floor = sum(r["floor_ms"] for r in part)
            ms = whole.get(key, {}).get(pipeline)
            out.append(dict(B=key[0], T=key[1], H=key[2], N=key[3], pipeline=pipeline,
                            gflop=sum(r["gflop"] for r in part), mbytes=sum(r["mbytes"] for r in part),
                            floor_ms=floor, ms=ms, of_floor=None if ms is None else floor / ms))
    return out


def summary_markdown(rows_: list[dict]) -> str:
    lines = ["| B,T,H | pipeline | GFLOP | MB | floor ms | backward ms (median) | floor / measured |",
             "|---|---|---|---|---|---|---|"]
    for r in rows_:
        shape = f"{r['B']},{r['T']},{r['H']}" + (f",packed={r['N']}" if r["N"] else "")
        ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
        share = "" if r["of_floor"] is None else f"{r['of_floor']:.0%}"
        lines.append(f"| {shape} | {r['pipeline']} | {r['gflop']:.1f} | {r['mbytes']:.0f} | {r['floor_ms']:.3f} | "
                     f"{ms} | {share} |")
    return "\n".join(lines) + "\n"


def markdown(table: list[dict]) -> str:
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    lines = ["| B,T,H | pipeline | kernel | GFLOP | MB | floor ms | measured ms | TFLOP/s | GB/s | floor / measured |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        if r["ms"] is None or r["pipeline"] == DESIGN or (r["B"], r["T"], r["H"], r["N"]) not in KERNEL_SHAPES:
            continue                                 # untimed by the kept profiles, or another shape
        shape = f"{r['B']},{r['T']},{r['H']}" + (f",packed={r['N']}" if r["N"] else "")
        lines.append(f"| {shape} | {r['pipeline']} | `{r['kernel']}` | {r['gflop']:.1f} | {r['mbytes']:.0f} | "
                     f"{r['floor_ms']:.3f} | {fmt(r['ms'], '.3f')} | {fmt(r['tflops'], '.0f')} | "
                     f"{fmt(r['gbps'], '.0f')} | {fmt(r['of_floor'], '.0%')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows and the per-chunk counts here")
    parser.add_argument("--markdown", type=Path, help="write the table here (printed otherwise)")
    args = parser.parse_args(argv)
    table = rows()
    if args.json:
        counts = {k: dict(zip(("flops", "bytes"), per_chunk(k))) for k in KERNELS}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(chunk=C, K=K, V=V, peak_tflops=PEAK_TFLOPS, peak_tbps=PEAK_TBPS,
                                             per_chunk_head=counts, rows=table, summary=summary(table)),
                                        indent=1) + "\n")
    text = summary_markdown(summary(table)) + "\n" + markdown(table)
    if args.markdown:
        args.markdown.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
