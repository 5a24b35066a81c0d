"""`rewy-hf demo`: a parity demo of the four ops on CPU, a few seconds on two cores.

For each op: random float64 inputs with an initial state and ragged length,
forward + backward through rewy's torch backend and through the token-by-token
reference, and the worst relative error over the output, the final state and
every input gradient. Exits 1 if any exceeds 1e-10.
"""

from __future__ import annotations

import argparse

HELP = "a CPU parity demo of a few seconds: the four ops' torch backend vs the float64 recurrence"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the demo is a fixed, reproducible check."""


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import ops
    from ..verify.op_checks import FLOAT64_SHAPE, FLOAT64_TOL, reference_error

    s = FLOAT64_SHAPE
    gen = torch.Generator().manual_seed(0)
    print("rewy-hf parity demo: torch backend (chunked forward + ReWY backward) vs float64 recurrence")
    print(f"shape B={s.B} T={s.T} H={s.H} K={s.K} V={s.V}, float64, with initial state and final-state gradient\n")
    print(f"{'op':<24}{'worst rel. error':>18}{'fwd+bwd (s)':>14}  verdict")
    ok = True
    for op in ops.__all__:
        worst, elapsed = reference_error(op, gen)
        passed = worst <= FLOAT64_TOL
        ok &= passed
        print(f"{op:<24}{worst:>18.2e}{elapsed:>14.3f}  {'PASS' if passed else 'FAIL'}")
    verdict = "all ops match" if ok else "MISMATCH"
    print(f"\n{verdict} (tolerance {FLOAT64_TOL:g}, relative error ||x - ref|| / ||ref||)")
    return 0 if ok else 1
