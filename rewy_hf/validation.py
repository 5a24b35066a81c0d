"""Checks shared by the public ops: every failure names the argument and the fix.

The checks of input values the core makes inside its boundary
(``check_cu_seqlens_values``, ``check_finite``) are defined with the kernels
(rewy_hf/kernels/value_checks.py) and exported here with the rest; so are the
names ``backend`` and ``policy`` take (rewy_hf/kernels/vocabulary.py).
"""

from __future__ import annotations

import math

import torch

from .errors import InputValidationError, UnsupportedConfigError
from .kernels.constants import CHUNK as SUPPORTED_CHUNK_SIZE
from .kernels.value_checks import check_cu_seqlens_values, check_finite
from .kernels.vocabulary import BACKENDS, POLICIES

__all__ = ["BACKENDS", "POLICIES", "SUPPORTED_CHUNK_SIZE", "check_chunk_size", "check_cu_seqlens",
           "check_cu_seqlens_values", "check_finite", "check_initial_state", "check_qkv", "check_scale",
           "check_shape", "check_tensor", "pop_fla_extras", "refuse_if_set", "resolve_backend", "resolve_policy"]


def check_tensor(name: str, x, rank: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputValidationError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.")
    if x.dim() != rank:
        raise InputValidationError(f"`{name}` must have rank {rank}, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise InputValidationError(f"`{name}` must be a floating-point tensor, got {x.dtype}.")


def check_shape(name: str, x: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise InputValidationError(
            f"`{name}` must have shape {meaning} = {list(expected)}, got {list(x.shape)}."
        )


def check_qkv(q, k, v, allow_gva: bool) -> tuple[int, int, int, int, int, int]:
    """Returns (B, T, H, K, HV, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
    if q.shape != k.shape:
        raise InputValidationError(f"`q` and `k` must have the same shape [B, T, H, K], got {list(q.shape)} and {list(k.shape)}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputValidationError(f"`q`, `k`, `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    B, T, H, K = q.shape
    if v.shape[:2] != q.shape[:2]:
        raise InputValidationError(f"`v` must have shape [B, T, HV, V] with B, T of q ({B}, {T}), got {list(v.shape)}.")
    HV, V = v.shape[2], v.shape[3]
    for name, n in (("H (heads of q and k)", H), ("K (key head dim)", K), ("HV (heads of v)", HV),
                    ("V (value head dim)", V)):
        if n == 0:
            raise InputValidationError(f"{name} must be at least 1, got 0 (q has shape {list(q.shape)}, "
                                       f"v {list(v.shape)}).")
    if HV != H and not allow_gva:
        raise UnsupportedConfigError(
            f"this op needs as many value heads as key heads (no GVA), got H={H} key heads and HV={HV} value heads."
        )
    if HV % H:
        raise InputValidationError(
            f"the number of value heads HV={HV} must be a multiple of the number of key heads H={H} (GVA)."
        )
    if T == 0:
        raise InputValidationError("the sequence length T must be at least 1, got 0.")
    return B, T, H, K, HV, V


def check_scale(scale) -> float:
    """``scale`` as a float. A tensor is accepted only as a constant: the core takes no gradient for
    it, so one that requires grad would be silently detached."""
    if isinstance(scale, torch.Tensor):
        if scale.requires_grad:
            raise UnsupportedConfigError(
                "`scale` is a tensor that requires grad, but rewy-hf treats scale as a constant (no gradient "
                "flows to it); pass a float, or scale q yourself before the op and pass scale=1.0.")
        if scale.numel() != 1:
            raise InputValidationError(f"`scale` must be one number, got a tensor of shape {list(scale.shape)}.")
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InputValidationError(f"`scale` must be a number (the query scale), got {type(scale).__name__} "
                                   f"{scale!r}.")
    value = float(scale)
    if not math.isfinite(value):
        raise InputValidationError(f"`scale` must be finite, got {value}.")
    return value


def check_cu_seqlens(cu_seqlens, B: int) -> int:
    """Returns the number of sequences N. Reads no tensor values (a traced call must not);
    ``check_cu_seqlens_values`` checks the bounds inside the core."""
    if cu_seqlens is None:
        return B
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()
            or cu_seqlens.dtype == torch.bool):
        raise InputValidationError("`cu_seqlens` must be a 1-D integer tensor of sequence offsets [0, ..., T].")
    if B != 1:
        raise InputValidationError(
            f"with `cu_seqlens` the batch size must be 1 (sequences packed along T), got B={B}; flatten the batch first."
        )
    if cu_seqlens.shape[0] < 2:
        raise InputValidationError(f"`cu_seqlens` must hold at least [0, T], got {cu_seqlens.shape[0]} value(s).")
    return cu_seqlens.shape[0] - 1


def check_initial_state(initial_state, N: int, HV: int, K: int, V: int, state_v_first: bool, compute_f64: bool) -> None:
    if initial_state is None:
        return
    check_tensor("initial_state", initial_state, 4)
    allowed = (torch.float32, torch.float64) if compute_f64 else (torch.float32,)
    if initial_state.dtype not in allowed:
        raise InputValidationError(
            f"`initial_state` must be float32 (as in FLA), got {initial_state.dtype}; pass initial_state.float()."
        )
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    check_shape("initial_state", initial_state, shape, "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]")


def check_chunk_size(chunk_size) -> None:
    if chunk_size != SUPPORTED_CHUNK_SIZE:
        raise UnsupportedConfigError(f"`chunk_size`={chunk_size} is not supported; rewy-hf uses chunk_size=64.")


def resolve_backend(backend: str, device: torch.device, triton_unsupported: str | None) -> str:
    """``auto`` picks triton on CUDA where rewy has Triton kernels for the call, else torch.

    ``triton_unsupported`` is None when the Triton backend can serve the call,
    else the reason it cannot.
    """
    if backend not in BACKENDS:
        raise UnsupportedConfigError(f"`backend`={backend!r} is unknown; choose one of {BACKENDS}.")
    if backend == "torch":
        return "torch"
    on_cuda = device.type == "cuda"
    if backend == "triton":
        if not on_cuda:
            raise UnsupportedConfigError(
                f"`backend`='triton' needs CUDA tensors, got tensors on {device}; use backend='torch' or 'auto'.")
        if triton_unsupported:
            raise UnsupportedConfigError(
                f"`backend`='triton' cannot serve this call: {triton_unsupported}; use backend='torch' or 'auto'.")
        return "triton"
    return "triton" if on_cuda and not triton_unsupported else "torch"


def resolve_policy(policy: str | None, disable_recompute: bool) -> str:
    if policy is None:
        return "full" if disable_recompute else "recompute"
    if policy not in POLICIES:
        raise UnsupportedConfigError(f"`policy`={policy!r} is unknown; choose one of {POLICIES}.")
    if disable_recompute and policy != "full":
        raise UnsupportedConfigError(
            f"`disable_recompute=True` means policy='full' but policy={policy!r} was given; pass only one of them."
        )
    return policy


def pop_fla_extras(op: str, kwargs: dict, allowed: tuple[str, ...]) -> dict:
    """Accept FLA's plumbing keywords that change nothing here; refuse the rest by name."""
    out = {}
    for key in list(kwargs):
        if key in allowed:
            out[key] = kwargs.pop(key)
    if "head_first" in kwargs:
        raise UnsupportedConfigError("`head_first` was removed in FLA; pass inputs as [B, T, H, D].")
    if kwargs:
        raise UnsupportedConfigError(
            f"{op}: unsupported keyword argument(s) {sorted(kwargs)}; supported extras are {sorted(allowed)}."
        )
    return out


def refuse_if_set(op: str, name: str, value, default) -> None:
    if value is not default and value != default:
        raise UnsupportedConfigError(f"{op}: `{name}`={value!r} is not supported by rewy-hf; leave it at {default!r}.")
