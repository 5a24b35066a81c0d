"""What the two local backward kernels of KDA / GDN2 share: sub-block size, product precisions, helpers.

The precisions are those that keep rewy's gradient errors at or below FLA's
own against an fp32 reference on the H200 at the least cost; the
alternatives and what they measured are in CHANGELOG.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of the Matrix Intra sub-blocks (FLA's BC): a chunk of 64 holds four.
SUB_BLOCK = 16
# Largest per-channel spread (log2 units) of a 16-row block's cumulative gate for which the diagonal
# block is done with tensor cores (intra_backward.py says why the bound is safe).
SPAN_LIMIT = 120.0
# Off-diagonal Matrix Intra products on fp32 operands: tf32, as FLA's own off-diagonal products.
INTRA_PRECISION = "tf32"
# The diagonal 16-row blocks carry the largest terms (e^{G_i - G_j} near 1) and the gate gradient sums
# them with cancellation: tf32x3 keeps KDA's dg error at FLA's (tf32 left it 1.5x FLA's).
DIAG_PRECISION = "tf32x3"
# The two Residual WY products that take an fp32 partial (A^T dW and dY Vn^T): the partial rounded to
# bf16, as FLA's kernel rounds it.
WY_PRECISION = "bf16"
# Key channels per Matrix Intra program: with its two warps per program, 64 is the fastest width.
INTRA_BLOCK_K = 64


def narrow_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """A final output dtype other than the fp32 of the partials (which are then updated in place)."""
    return None if dtype == torch.float32 else dtype


def alloc(shape, device, dtype=torch.float32):
    """Output allocation; the tests replace it with NaN-filled buffers, so an unwritten output fails."""
    return torch.empty(shape, device=device, dtype=dtype)


@triton.jit
def exp2_where(m, x):
    """exp2(x) where m, else 0, with the exponent masked first (no inf in dead lanes)."""
    return tl.exp2(tl.where(m, x, float("-inf")))


@triton.jit
def dot_prec(a, b, acc, NARROW: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b for fp32 operands: rounded to NARROW (the inputs' dtype) when PREC is "bf16", else
    multiplied at input precision PREC."""
    if PREC == "bf16":
        return tl.dot(a.to(NARROW), b.to(NARROW), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def add_before(total_a, before_a, total_b, before_b):
    """Combine of a scan over (x, 0) pairs whose second part is the sum of the x strictly before each
    row: the exclusive sum without forming an inclusive sum and taking the row away again."""
    return total_a + total_b, total_a + before_b
