"""One independent stage on a second CUDA stream, beside a stage that leaves SMs idle
(REWY_HF_OVERLAP_DV_LOCAL, REWY_HF_OVERLAP_DQ).

Under policy ``recompute`` GDN / DeltaNet's backward runs, in order: the w/u
recompute, the state recurrence ``fwd_h``, the local value gradient
dV_loc = A_qk^T dO, the reverse recurrence ``bwd_dhu``. ``fwd_h`` walks the
chunks of a sequence one after another with one program per (sequence, head,
value block): at (2, 8192, 16) that is 128 programs of 4 warps on the H200's
132 SMs, and it takes 0.155 ms while most of each SM sits idle. dV_loc needs
only q, k, g and dO, none of which ``fwd_h`` writes, so it can run at the same
time on a second stream, in those idle slots, instead of 0.073 ms after it.

The same holds for the reverse recurrence ``bwd_dhu`` (0.27 ms there) and the
output side of rewy's local kernel: dq, and P2 = dAqk * Gamma, need h, Vn, dO,
q, k and the gate, but neither dh nor dVn, which ``bwd_dhu`` writes. With
REWY_HF_OVERLAP_DQ=1 the local kernel runs in two parts (triton_gdn_bwd.py,
PART 1 and 2), the first beside ``bwd_dhu``; the second, the key side, has
four of the loop's six products and three of the end's four.

``fork`` makes the side stream wait for everything already queued on the
current stream (the w/u recompute: launched first, so ``fwd_h``'s programs
are dispatched before the side stream's), ``aside`` runs the stage there, and
``join`` makes the current stream wait for the side stream before the stage
that reads its output. The allocator is told which streams use which tensors
(``record_stream``), so no memory is handed out again while the other stream
may still read or write it. Off the GPU there is no second stream: the local
dv runs where it would without its switch, and the local kernel's two parts
run one after the other.
"""

from __future__ import annotations

import contextlib

import torch

from .env_switch import flag

OVERLAP_DV_LOCAL_ENV = "REWY_HF_OVERLAP_DV_LOCAL"
OVERLAP_DQ_ENV = "REWY_HF_OVERLAP_DQ"

_SIDE: dict[int, object] = {}   # one side stream per device, made on first use
_cuda = torch.cuda              # the stream API; the CPU tests put a recording stand-in here


def _record(t: torch.Tensor, stream) -> None:
    t.record_stream(stream)


def overlap_dv_local(device: torch.device) -> bool:
    """Whether the local dv runs beside ``fwd_h`` (the switch, and a CUDA device)."""
    on = flag(OVERLAP_DV_LOCAL_ENV, False, on="the local dv beside fwd_h on a second stream",
              off="the local dv after fwd_h on the current stream")
    return on and has_streams(device)


def overlap_dq() -> bool:
    """Whether the local kernel runs in two parts, its output side (dq and P2) beside ``bwd_dhu``
    (REWY_HF_OVERLAP_DQ; off the GPU the two parts run one after the other)."""
    return flag(OVERLAP_DQ_ENV, False, on="the local kernel's output side beside bwd_dhu",
                off="the local kernel in one part after bwd_dhu")


def has_streams(device: torch.device) -> bool:
    return device.type == "cuda"


def fork(device: torch.device):
    """The side stream of ``device``, made to wait for the work queued so far on the current stream."""
    index = device.index if device.index is not None else _cuda.current_device()
    side = _SIDE.get(index)
    if side is None:
        side = _SIDE[index] = _cuda.Stream(device=index)
    side.wait_stream(_cuda.current_stream(device))
    return side


@contextlib.contextmanager
def aside(side, reads):
    """Queue the block's launches on ``side``; ``reads``: tensors of the current stream it reads
    (None entries are skipped), kept from reuse until the side stream is done with them."""
    with _cuda.stream(side):
        yield
    for t in reads:
        if t is not None:
            _record(t, side)


def join(side, device: torch.device, outputs) -> None:
    """The current stream waits for ``side``; ``outputs`` (made on ``side``) are then read on the
    current stream, so their memory is not reused before that stream is done with them."""
    main = _cuda.current_stream(device)
    main.wait_stream(side)
    for t in outputs:
        _record(t, main)
