"""`rewy-hf verify` on CUDA: the Triton backend against the fp32 torch backend.

BF16 inputs, built as the op-level bench builds them (``bench_ops.make_inputs``);
the reference is the torch backend on the same values in float32. The bound
(2e-2 relative) is BF16 rounding of the inputs and outputs.
"""

from __future__ import annotations

import torch

from .bench_config import Shape
from .bench_ops import REWY_OPS, make_inputs
from .rel_error import rel_err

BF16_TOL = 2e-2
SHAPE = Shape(B=2, T=300, H=4, K=128, V=128)


def triton_checks():
    for op in ("gdn", "delta_rule", "kda", "gdn2"):
        args, do = make_inputs(op, SHAPE, "cuda", torch.bfloat16, seed=0)
        fn = REWY_OPS[op]
        results = []
        for backend, inputs in (("torch", [a.float() for a in args]), ("triton", args)):
            leaves = [a.detach().requires_grad_() for a in inputs]
            o, _ = fn(*leaves, backend=backend)
            results.append([o.float()] + [g.float() for g in torch.autograd.grad((o.float() * do).sum(), leaves)])
        worst = max(rel_err(x, r) for x, r in zip(results[1], results[0]))
        yield (f"{fn.__name__} triton backend vs fp32", worst <= BF16_TOL,
               f"worst rel. error {worst:.1e} (tol {BF16_TOL:g})")
