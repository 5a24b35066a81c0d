"""The short convolution of a patched eager layer on FLA's Triton kernels, on FLA's Gluon kernels,
and as transformers' torch path runs it, on a GPU.

    python $REPO/dev/conv_bench.py [--json out.json]

For each shape (rows x tokens x channels, width 4, SiLU, bf16; packed rows with log-normal document
lengths as the packed bench draws them), first the check: values and input / weight gradients of each side against
the documents run one by one through ``F.conv1d`` in float64 (relative error). Then forward and
forward + backward as a patched layer calls them (x a transposed [B, C, T] view of a [B, T, C]
tensor, the output gradient a transposed view too), two ways: the kernels' own GPU time (summed over
every kernel the call launches, from the profiler, per call), which is what a model step pays while
the host runs ahead, and the call's wall time with the device synchronised around it (CUDA events,
median of 50 after 10 warm-up calls), which also counts the host's launch work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from rewy_hf.bench.packed_bench import packed_lengths
from rewy_hf.rel_error import rel_err

# (B, T, C, packed): the ~1 B presets' convolutions (Qwen3.5-like: 2 x 2048 key + 4096 value
# channels; Kimi-Linear-like: 3 x 2048) at B x T = 8192, as one packed row and as two rows of 4096.
SHAPES = [(1, 8192, 8192, True), (2, 4096, 6144, False)]
W = 4


def reference(x, w, lens):
    """x [B, C, T] float64, documents one by one."""
    parts = x.split(lens, -1) if lens else [x]
    return torch.cat([F.silu(F.conv1d(p, w[:, None], None, padding=W - 1, groups=p.shape[1])[..., :p.shape[-1]])
                      for p in parts], -1)


def convs():
    """Each side: a function of (x [B, C, T] view, weight [C, W], cu_seqlens or None), and the value
    of ``FLA_CONV_GLUON`` it runs under (FLA reads it at every forward and backward call, and takes its
    Gluon kernels where it is 1)."""
    from fla.modules.convolution import causal_conv1d

    def fla(x, w, cu):         # as a patched layer's eager call reaches it
        out, _ = causal_conv1d(x.transpose(1, 2), w, None, activation="silu", backend="triton", cu_seqlens=cu)
        return out.transpose(1, 2)

    def torch_path(x, w, cu):      # transformers' fallback: bf16 F.conv1d then SiLU; ignores the bounds
        return F.silu(F.conv1d(x, w[:, None], None, padding=W - 1, groups=x.shape[1])[..., :x.shape[-1]])

    return {"fla-triton": (fla, "0"), "fla-gluon": (fla, "1"), "torch": (torch_path, "0")}


def gluon_ran() -> bool:
    """Whether FLA's Gluon convolution is importable here (FLA falls back to Triton otherwise)."""
    from fla.backends import GluonBackend

    return GluonBackend.is_available()


def timed(fn, reps: int = 50) -> float:
    for _ in range(10):
        fn()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def gpu_ms(fn, reps: int = 20) -> tuple[float, list[str]]:
    """Kernel time per call of ``fn`` on the GPU, summed over the kernels it launches, and their names
    (which say whether FLA took its Gluon or its Triton kernels)."""
    from rewy_hf.bench.kernel_profile import kernel_times

    def many():
        for _ in range(reps):
            fn()

    times = kernel_times(many, "cuda")
    return sum(v["ms"] for v in times.values()) / reps, sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"FLA's Gluon convolution importable: {gluon_ran()}")
    gen = torch.Generator().manual_seed(0)
    for B, T, C, packed in SHAPES:
        lens = packed_lengths(T, gen) if packed else None
        cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                                    dtype=torch.int32, device="cuda")
        x64 = torch.randn(B, T, C, dtype=torch.float64, device="cuda").transpose(1, 2)
        w64 = torch.randn(C, W, dtype=torch.float64, device="cuda") * 0.5
        dy64 = torch.randn(B, T, C, dtype=torch.float64, device="cuda").transpose(1, 2)
        xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
        ref = reference(xr, wr, lens)
        ref_grads = torch.autograd.grad((ref * dy64).sum(), (xr, wr))
        row = {"B": B, "T": T, "C": C, "documents": len(lens) if lens else None}
        for name, (conv, gluon) in convs().items():
            os.environ["FLA_CONV_GLUON"] = gluon
            x = x64.to(torch.bfloat16).detach().requires_grad_()
            w = w64.to(torch.bfloat16).detach().requires_grad_()
            dy = dy64.to(torch.bfloat16)
            out = conv(x, w, cu)
            grads = torch.autograd.grad(out, (x, w), dy)
            errs = [rel_err(a, r) for a, r in zip((out, *grads), (ref, *ref_grads))]

            def fwd():
                with torch.no_grad():
                    conv(x, w, cu)

            def fwd_bwd():
                torch.autograd.grad(conv(x, w, cu), (x, w), dy)

            (fwd_gpu, _), (fwd_bwd_gpu, kernels) = gpu_ms(fwd), gpu_ms(fwd_bwd)
            row[name] = {"rel_err_y_dx_dw": errs, "fwd_ms": timed(fwd), "fwd_bwd_ms": timed(fwd_bwd),
                         "fwd_gpu_ms": fwd_gpu, "fwd_bwd_gpu_ms": fwd_bwd_gpu, "kernels": kernels}
            os.environ.pop("FLA_CONV_GLUON")
        rows.append(row)
        print(f"B={B} T={T} C={C} docs={row['documents']}: " + "  ".join(
            f"{n} GPU fwd {row[n]['fwd_gpu_ms']:.3f} fwd+bwd {row[n]['fwd_bwd_gpu_ms']:.3f} ms, wall fwd "
            f"{row[n]['fwd_ms']:.3f} fwd+bwd {row[n]['fwd_bwd_ms']:.3f} ms, err "
            + "/".join(f"{e:.1e}" for e in row[n]["rel_err_y_dx_dw"]) for n in convs()), flush=True)
        print("  kernels: " + "; ".join(f"{n}: {', '.join(row[n]['kernels'])}" for n in convs()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gluon_available": gluon_ran(), "width": W,
                       "dtype": "bfloat16", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
