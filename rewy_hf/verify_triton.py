"""`rewy-hf verify` on CUDA: the Triton backend against the fp32 torch backend.

BF16 inputs; the reference is the torch backend on the same values in
float32. The bound (2e-2 relative) is BF16 rounding of the inputs and outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops

BF16_TOL = 2e-2


def _case(op: str, gen: torch.Generator):
    B, T, H, K, V = 2, 300, 4, 128, 128
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    u = lambda *s: torch.rand(*s, device="cuda", generator=gen)
    q, k, v = r(B, T, H, K).bfloat16(), F.normalize(r(B, T, H, K), dim=-1).bfloat16(), r(B, T, H, V).bfloat16()
    if op == "chunk_delta_rule":
        rest = [u(B, T, H)]
    elif op == "chunk_gated_delta_rule":
        rest = [F.logsigmoid(r(B, T, H)), u(B, T, H)]
    elif op == "chunk_kda":
        rest = [F.logsigmoid(r(B, T, H, K)), u(B, T, H)]
    else:
        rest = [F.logsigmoid(r(B, T, H, K)), u(B, T, H, K), u(B, T, H, V)]
    return [q, k, v, *rest], r(B, T, H, V)


def triton_checks():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for op in ("chunk_gated_delta_rule", "chunk_delta_rule", "chunk_kda", "chunk_gdn2"):
        args, do = _case(op, gen)
        fn = getattr(ops, op)
        results = []
        for backend, inputs in (("torch", [a.float() for a in args]), ("triton", args)):
            leaves = [a.detach().requires_grad_() for a in inputs]
            o, _ = fn(*leaves, backend=backend)
            results.append([o.float()] + [g.float() for g in torch.autograd.grad((o.float() * do).sum(), leaves)])
        worst = max(((x - r).norm() / r.norm()).item() for x, r in zip(results[1], results[0]))
        yield f"{op} triton backend vs fp32", worst <= BF16_TOL, f"worst rel. error {worst:.1e} (tol {BF16_TOL:g})"
