"""Per-stage times of the GDN backward on the GPU: FLA's stages vs rewy's kernel.

Times, at one shape, each stage FLA's backward runs (w/u recompute, state
recurrence, local dv, reverse state recurrence, ``chunk_bwd_dqkwg``,
``prepare_wy_repr_bwd``) and rewy's fused local kernel (autotuned) and, where B x H leaves SMs idle,
rewy's sequence-parallel state recurrences, so the per-kernel gap is visible. FLA's
``chunk_bwd_dqkwg`` guard for Triton < 3.7.1 on Hopper is lifted: its time is
measured, its output is not used.

Usage: python benchmarks/gdn_bwd_stages.py --B 2 --T 8192 --H 16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton


def kernel_times(fn) -> list[tuple[str, float]]:
    """Device time (ms) of each GPU kernel one call of ``fn`` launches, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "Memset" not in e.name]
    return [(e.name, (e.time_range.end - e.time_range.start) / 1000.0)
            for e in sorted(kernels, key=lambda e: e.time_range.start)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    a = p.parse_args()
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    from rewy_hf.kernels.triton_gdn_bwd import rewy_gdn_bwd_local
    from rewy_hf.kernels.triton_state_scan import segments_for, state_backward, state_forward

    chunk_o.TRITON_ABOVE_3_7_1 = True
    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, K, device=dev, dtype=bf)
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
    v = torch.randn(B, T, H, V, device=dev, dtype=bf)
    beta = torch.rand(B, T, H, device=dev, dtype=bf)
    g = chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device=dev)), chunk_size=64, scale=1.4426950408889634)
    do = torch.randn(B, T, H, V, device=dev, dtype=bf)
    scale = K ** -0.5
    w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, chunk_size=64)
    dv = chunk_bwd_dv_local(q=q, k=k, do=do, g=g, scale=scale, chunk_size=64)
    dh, _, dv2 = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, g=g, scale=scale, chunk_size=64)
    t = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    rows = {
        "recompute_w_u": t(lambda: recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g)),
        "fwd_h": t(lambda: chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, chunk_size=64)),
        "dv_local": t(lambda: chunk_bwd_dv_local(q=q, k=k, do=do, g=g, scale=scale, chunk_size=64)),
        "bwd_dhu": t(lambda: chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, g=g, scale=scale,
                                                            chunk_size=64)),
        "FLA dqkwg (timing only)": t(lambda: chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv2, do=do, dh=dh,
                                                             scale=scale, chunk_size=64)),
        "FLA prepare_wy_repr_bwd": t(lambda: prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=A, dw=w, du=dv2)),
    }
    rows["rewy local kernel (autotuned)"] = t(lambda: rewy_gdn_bwd_local(
        q, k, v, v_new, g, beta, A, h, dh, do, dv2, scale=scale))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ns = segments_for(B, H, T, V, sms)
    if ns > 1:
        rows[f"rewy sequence-parallel fwd_h (NS={ns})"] = t(lambda: state_forward(k, w, u, g, None, ns))
        rows[f"rewy sequence-parallel bwd_dhu (NS={ns})"] = t(lambda: state_backward(q, k, w, do, dv, g, None,
                                                                                      scale, ns))
        # Which phase is slow: each kernel of one call, in launch order (augmented pass, scan, rerun).
        for name, fn in (("fwd_h", lambda: state_forward(k, w, u, g, None, ns)),
                         ("bwd_dhu", lambda: state_backward(q, k, w, do, dv, g, None, scale, ns))):
            for i, (kernel, ms) in enumerate(kernel_times(fn)):
                rows[f"  {name} phase {i + 1}: {kernel[:24]}"] = ms
    best = rewy_gdn_bwd_local.__globals__["rewy_gdn_bwd_local_kernel"].best_config
    print(f"rewy kernel best config: {best}")
    print(f"GDN backward stages at B={B} T={T} H={H} K={K} V={V} (bf16, median ms)")
    for name, ms in rows.items():
        print(f"  {name:<32} {ms:7.3f}")


if __name__ == "__main__":
    main()
