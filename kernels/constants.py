"""Constants every backend shares.

CHUNK: tokens per chunk of the chunked forms. FLA 0.6.0's kernels, which the
triton backend reuses for the stages ReWY leaves alone, are built for 64, and
the torch backend uses the same chunking so that both compute the same sums
in the same grouping.

RCP_LN2: 1 / ln 2. FLA keeps chunk-local gate cumsums in log2 units (it scales
by this and uses exp2), and rewy's Triton kernels read them as FLA writes them.

LOG_GATE_FLOOR: log-gates below this are raised to it. Below about -103.3
(-744.4 in float64) e^g is exactly zero in the compute dtype, so the floor
changes no decay, while a log-gate of -inf (a hard reset of the state) would
otherwise meet another -inf in the differences G_i - G_j and turn into NaN.
"""

CHUNK = 64
RCP_LN2 = 1.4426950408889634


LOG_GATE_FLOOR = -105.0
LOG_GATE_FLOOR_FLOAT64 = -746.0


def log_gate_floor(dtype) -> float:
    """LOG_GATE_FLOOR for a compute dtype (float32 unless float64)."""
    import torch

    return LOG_GATE_FLOOR_FLOAT64 if dtype == torch.float64 else LOG_GATE_FLOOR
