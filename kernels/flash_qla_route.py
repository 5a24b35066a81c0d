"""When ``backend="auto"`` sends a Gated DeltaNet call to FlashQLA instead of rewy's Triton kernels.

Whether FlashQLA can serve the call (``unsupported_reason``), answered without reading a tensor's
values (a traced call must not): its package is importable, the GPU is Hopper (SM90) or
SM100/SM103 (SM120 has its forward only), q, k and v are bfloat16 or float16 alike, K = V = 128,
and the erase strength is in [0, 1] (no negative eigenvalues: FlashQLA is not built for them).
Gate and beta activations and the l2norm run in rewy before the core, so FLA's other refusals
(``use_gate_in_kernel``, beta sigmoid) do not apply here.

Where it can, it is also faster: forward + backward, both sides in one process on the H200
(``rewy-hf bench --op gdn --backend triton --peers flash-qla``, docs/bench/flashqla,
docs/performance.md "GDN against FlashQLA"), FlashQLA led at every shape measured under both
policies. rewy's forward at 16 heads runs FLA's launch-bound stages, so its forward + backward
varies by a third between rounds where FlashQLA's does not; no shape class was found where rewy's
median is ahead.

``choose`` says which backend serves a call and why, for the dispatch report.
"""

from __future__ import annotations

import importlib.util

import torch

from .vocabulary import FLASH_QLA


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


def choose(q, k, v, neg_eigval: bool) -> tuple[str, str]:
    """(backend, why) for an ``auto`` GDN call that rewy's Triton kernels can serve."""
    if (reason := unsupported_reason(q, k, v, neg_eigval)) is not None:
        return "triton", reason
    return FLASH_QLA, "FlashQLA serves this call and is faster"
