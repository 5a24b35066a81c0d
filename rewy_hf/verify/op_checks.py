"""Per-op checks behind `rewy-hf demo` and the ops group of `rewy-hf verify`.

``reference_error``: rewy's torch backend against the float64 token-by-token
recurrence (run on CPU), on random float64 inputs with an initial state and a
ragged length, over the output, the final state and every input gradient.

``triton_checks``: on CUDA, the Triton backend against the torch backend on
the same BF16 inputs in float32; the bound (2e-2 relative) is BF16 rounding of
the inputs and outputs.
"""

from __future__ import annotations

import time

import torch

from .. import ops
from ..kernels import reference
from ..kernels.vocabulary import family_of_public
from ..op_inputs import OPS, REWY_OPS, Shape, float64_inputs, make_inputs
from ..rel_error import rel_err

FLOAT64_TOL = 1e-10
FLOAT64_SHAPE = Shape(B=2, T=200, H=2, K=32, V=32)
BF16_TOL = 2e-2
TRITON_SHAPE = Shape(B=2, T=300, H=4, K=128, V=128)

# Per delta-rule family.
REFERENCES = {"delta_rule": reference.naive_delta_rule, "gdn": reference.naive_gated_delta_rule,
              "kda": reference.naive_kda, "gdn2": reference.naive_gdn2}


def reference_error(op: str, gen: torch.Generator, device: str = "cpu") -> tuple[float, float]:
    """Worst relative error of rewy's torch backend against the float64 recurrence for the public op
    ``op`` (``chunk_kda``, ...), and the seconds rewy took."""
    args, h0 = float64_inputs(op, gen, FLOAT64_SHAPE)
    h0.requires_grad_()
    leaves = args + [h0]
    on_device = [x.detach().to(device).requires_grad_() for x in leaves]
    t0 = time.perf_counter()
    o, ht = getattr(ops, op)(*on_device[:-1], initial_state=on_device[-1], output_final_state=True, backend="torch")
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    grads = torch.autograd.grad((o * do.to(device)).sum() + (ht * dht.to(device)).sum(), on_device)
    grads = [g.cpu() for g in grads]
    o, ht = o.cpu(), ht.cpu()
    elapsed = time.perf_counter() - t0
    o_r, ht_r = REFERENCES[family_of_public(op)](*args, initial_state=h0, output_final_state=True)
    grads_r = torch.autograd.grad((o_r * do).sum() + (ht_r * dht).sum(), leaves)
    worst = max([rel_err(o, o_r), rel_err(ht, ht_r)] + [rel_err(a, b) for a, b in zip(grads, grads_r)])
    return worst, elapsed


def triton_checks():
    """(name, ok, detail) per op: the Triton backend against the fp32 torch backend on CUDA."""
    for op in OPS:
        args, do = make_inputs(op, TRITON_SHAPE, "cuda", torch.bfloat16, seed=0)
        fn = REWY_OPS[op]
        results = []
        for backend, inputs in (("torch", [a.float() for a in args]), ("triton", args)):
            leaves = [a.detach().requires_grad_() for a in inputs]
            o, _ = fn(*leaves, backend=backend)
            results.append([o.float()] + [g.float() for g in torch.autograd.grad((o.float() * do).sum(), leaves)])
        worst = max(rel_err(x, r) for x, r in zip(results[1], results[0]))
        yield (f"{fn.__name__} triton backend vs fp32", worst <= BF16_TOL,
               f"worst rel. error {worst:.1e} (tol {BF16_TOL:g})")
