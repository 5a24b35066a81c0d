"""When ``backend="auto"`` sends a Gated DeltaNet call to FlashQLA instead of rewy's Triton kernels.

Two questions, both answered without reading a tensor's values (a traced call must not):

- can FlashQLA serve the call? (``unsupported_reason``) Its package is importable, the GPU is
  Hopper (SM90) or SM100/SM103 (SM120 has its forward only), q, k and v are bfloat16 or float16
  alike, K = V = 128, and the erase strength is in [0, 1] (no negative eigenvalues: FlashQLA is
  not built for them). Gate and beta activations and the l2norm run in rewy before the core, so
  FLA's other refusals (``use_gate_in_kernel``, beta sigmoid) do not apply here.
- is it faster there? (``rewy_faster_reason``) By a rule read off forward + backward times on
  the H200 (docs/bench/flashqla, docs/performance.md "GDN against FlashQLA"), which
  ``rewy-hf bench --op gdn --backend triton --peers flash-qla`` measures in one process.

``choose`` combines them and says why, for the dispatch report.
"""

from __future__ import annotations

import importlib.util

import torch

BACKEND = "flash_qla"
# Measured (H200, bf16, K = V = 128, forward + backward, both sides in one process): FlashQLA runs
# one block per (sequence, value head) and splits a sequence across the GPU only when there is one.
# With several dense sequences and fewer than this many (sequence, head) blocks, most of the GPU
# idles through its walk, and rewy's chunk-parallel kernels are faster under either policy (at
# (2, 8192, 16): 1.82 against 1.97 ms under recompute, 1.64 against 1.95 ms under full); at 64 and
# 128 blocks FlashQLA was faster under both.
FEW_BLOCKS = 64


def _probe(device_type: str, index: int) -> str | None:
    if importlib.util.find_spec("flash_qla") is None:
        return "flash-qla is not installed"
    if device_type != "cuda":
        return f"the inputs are on {device_type}, not on a CUDA device"
    major, minor = torch.cuda.get_device_capability(None if index < 0 else index)
    if (major, minor) not in ((9, 0), (10, 0), (10, 3)):
        return f"FlashQLA's backward runs on SM90 and SM100/SM103 only, this GPU is SM{major}{minor}"
    return None


_PROBED: dict[tuple[str, int], str | None] = {}


def environment_reason(device_type: str, index: int) -> str | None:
    """Why FlashQLA cannot run on this device of this process at all, or None. A constant of the
    process (probed once per device): dynamo calls it while tracing and keeps the result, since
    traced code may not call find_spec or read the device's capability."""
    if (device_type, index) not in _PROBED:
        _PROBED[device_type, index] = _probe(device_type, index)
    return _PROBED[device_type, index]


environment_reason = torch.compiler.assume_constant_result(environment_reason)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, neg_eigval: bool) -> str | None:
    """Why FlashQLA cannot serve this GDN call, or None if it can."""
    index = -1 if q.device.index is None else q.device.index
    if (reason := environment_reason(q.device.type, index)) is not None:
        return reason
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return f"FlashQLA needs q, k, v in one of bfloat16 / float16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"FlashQLA needs K = V = 128, got K = {q.shape[-1]}, V = {v.shape[-1]}"
    if neg_eigval:
        return "FlashQLA does not take allow_neg_eigval (erase strengths above 1)"
    return None


def rewy_faster_reason(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> str | None:
    """Why rewy's Triton kernels are faster for this call by the measured rule, or None."""
    B, HV = q.shape[0], v.shape[2]
    if cu_seqlens is None and B > 1 and B * HV < FEW_BLOCKS:
        return (f"rewy is faster here: {B} dense sequences x {HV} heads = {B * HV} blocks < {FEW_BLOCKS} leave "
                "FlashQLA's walk on few SMs")
    return None


def choose(q, k, v, cu_seqlens, neg_eigval: bool) -> tuple[str, str]:
    """(backend, why) for an ``auto`` GDN call that rewy's Triton kernels can serve."""
    if (reason := unsupported_reason(q, k, v, neg_eigval)) is not None:
        return "triton", reason
    if (reason := rewy_faster_reason(q, v, cu_seqlens)) is not None:
        return "triton", reason
    return BACKEND, "FlashQLA serves this call and is faster at its shape"
