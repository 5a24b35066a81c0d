"""A one-minute parity demo of the four ops on CPU (the README's first command).

For each op: random float64 inputs with an initial state and ragged length,
forward + backward through rewy's torch backend and through the token-by-token
reference, and the worst relative error over the output, the final state and
every input gradient. Exits 1 if any exceeds 1e-10.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from . import ops
from .kernels import reference
from .rel_error import rel_err

TOL = 1e-10


def _inputs(op: str, gen: torch.Generator, B=2, T=200, H=2, K=32, V=32):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    if op == "chunk_delta_rule":
        args = [q, k, v, u(B, T, H)]
    elif op == "chunk_gated_delta_rule":
        args = [q, k, v, F.logsigmoid(r(B, T, H)), u(B, T, H)]
    elif op == "chunk_kda":
        args = [q, k, v, F.logsigmoid(r(B, T, H, K)), u(B, T, H)]
    else:
        args = [q, k, v, F.logsigmoid(r(B, T, H, K)), u(B, T, H, K), u(B, T, H, V)]
    return [a.requires_grad_() for a in args], 0.5 * r(B, H, K, V)


def run_op(op: str, gen: torch.Generator, device: str = "cpu") -> tuple[float, float]:
    """Worst relative error of rewy's torch backend against the float64
    recurrence (run on CPU) for one op, and the seconds rewy took."""
    args, h0 = _inputs(op, gen)
    h0.requires_grad_()
    ref_fn = {"chunk_delta_rule": reference.naive_delta_rule, "chunk_gated_delta_rule":
              reference.naive_gated_delta_rule, "chunk_kda": reference.naive_kda,
              "chunk_gdn2": reference.naive_gdn2}[op]
    leaves = args + [h0]
    on_device = [x.detach().to(device).requires_grad_() for x in leaves]
    t0 = time.perf_counter()
    o, ht = getattr(ops, op)(*on_device[:-1], initial_state=on_device[-1], output_final_state=True, backend="torch")
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    grads = torch.autograd.grad((o * do.to(device)).sum() + (ht * dht.to(device)).sum(), on_device)
    grads = [g.cpu() for g in grads]
    o, ht = o.cpu(), ht.cpu()
    elapsed = time.perf_counter() - t0
    o_r, ht_r = ref_fn(*args, initial_state=h0, output_final_state=True)
    grads_r = torch.autograd.grad((o_r * do).sum() + (ht_r * dht).sum(), leaves)
    worst = max([rel_err(o, o_r), rel_err(ht, ht_r)] + [rel_err(a, b) for a, b in zip(grads, grads_r)])
    return worst, elapsed


HELP = "one-minute CPU parity demo: the four ops' torch backend vs the float64 recurrence"


def add_arguments(parser) -> None:
    """No options: the demo is a fixed, reproducible check."""


def run(args) -> int:
    return main()


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    print("rewy-hf parity demo: torch backend (chunked forward + ReWY backward) vs float64 recurrence")
    print("shape B=2 T=200 H=2 K=V=32, float64, with initial state and final-state gradient\n")
    print(f"{'op':<24}{'worst rel. error':>18}{'fwd+bwd (s)':>14}  verdict")
    ok = True
    for op in ops.__all__:
        worst, elapsed = run_op(op, gen)
        passed = worst <= TOL
        ok &= passed
        print(f"{op:<24}{worst:>18.2e}{elapsed:>14.3f}  {'PASS' if passed else 'FAIL'}")
    print(f"\n{'all ops match' if ok else 'MISMATCH'} (tolerance {TOL:g}, relative error ||x - ref|| / ||ref||)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
