"""Public delta-rule ops with FLA 0.6.0's names, argument order and return value.

Each op validates its inputs, applies the activations FLA fuses into its
kernels (q/k l2norm, gate and beta activations) as torch ops (the gate as one
autograd node that keeps its raw input, kernels/gate_activation.py), and
hands the activated tensors to the selected backend, whose autograd Function
runs the chunked forward and the ReWY backward. Extra keyword arguments:
``backend`` ("auto", "torch", "triton") and ``policy`` ("recompute", "full";
FLA's ``disable_recompute=True`` means "full").
"""

from __future__ import annotations

import threading
import warnings

import torch

from .errors import InputValidationError, UnsupportedConfigError
from .kernels.core import CoreArgs, delta_rule
from .kernels.gate_activation import scalar_gate, vector_gate
from .kernels.reference import beta_activation, l2norm
from .kernels.torch_backend import compute_dtype
from .validation import (
    check_chunk_size,
    check_cu_seqlens,
    check_finite,
    check_initial_state,
    check_qkv,
    check_scale,
    check_shape,
    check_tensor,
    pop_fla_extras,
    refuse_if_set,
    resolve_backend,
    resolve_policy,
)

__all__ = ["chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2"]

# The backend that served this thread's latest call (read by the dispatcher's report). A
# thread-local rather than a ContextVar: torch.compile traces attribute access on it.
class _CallState(threading.local):
    # Both attributes exist from each thread's first access on: a traced read of a missing one
    # would be a guard that recompiles once the first call sets it.
    def __init__(self):
        self.backend: str | None = None
        self.report_as = ""


_LAST = _CallState()


def last_backend() -> str | None:
    """The backend ("torch" or "triton") that served this thread's latest op call."""
    return _LAST.backend


def reporting_as(op: str):
    """Calls made inside ``with reporting_as(op):`` have their backward counted in the
    dispatch report as ``op`` (the dispatcher wraps the calls of patched layers)."""
    return _Reporting(op)


class _Reporting:
    # A plain class (not contextlib.contextmanager): dynamo traces its __enter__ / __exit__.
    def __init__(self, op: str):
        self.op = op

    def __enter__(self):
        self.previous = _LAST.report_as
        _LAST.report_as = self.op

    def __exit__(self, *exc):
        _LAST.report_as = self.previous
_WARNED_TORCH_ON_GPU: set[str] = set()

_PLUMBING = ("chunk_size", "chunk_indices", "cu_seqlens_cpu", "transpose_state_layout", "disable_recompute")


def _state_layout(state_v_first: bool, extras: dict) -> bool:
    if "transpose_state_layout" not in extras:
        return state_v_first
    if state_v_first:
        raise UnsupportedConfigError("pass either `state_v_first` or the deprecated `transpose_state_layout`, not both.")
    warnings.warn("`transpose_state_layout` is deprecated; use `state_v_first`.", DeprecationWarning, stacklevel=3)
    return bool(extras["transpose_state_layout"])


def _run(family, chosen, q, k, v, g, beta, w, scale, initial_state, output_final_state, cu_seqlens,
         state_v_first, policy, qk_l2norm, safe_gate=False, why="", cp_context=None):
    """The core on the chosen backend. The torch backend takes q and k normalised (in float32,
    float64 staying float64, as plain torch ops autograd chains through); the Triton backend
    normalises inside the core (kernels/triton_backend/qk_l2norm.py)."""
    if chosen == "torch" and qk_l2norm:
        dt = compute_dtype(q)
        q, k, qk_l2norm = l2norm(q.to(dt)), l2norm(k.to(dt)), False
    a = CoreArgs(q, k, v, g, beta, w, initial_state, cu_seqlens, scale, family, policy, state_v_first, qk_l2norm,
                 safe_gate, _LAST.report_as, why)
    if cp_context is not None:
        from .kernels.context_parallel import cp_delta_rule

        return cp_delta_rule(a, chosen, cp_context), None
    o, ht = delta_rule(a, chosen)
    return o, (ht if output_final_state else None)


def _cp_split(op, cp_context, q, initial_state, output_final_state, cu_seqlens):
    """(cu_seqlens, the context-parallel call or None): under context parallelism the context's local
    bounds (as FLA), and the context as a CPCall (kernels/context_parallel_call.py)."""
    if cp_context is None:
        return cu_seqlens, None
    from .kernels.context_parallel import check_call
    from .kernels.context_parallel_call import cp_call

    call = cp_call(op, cp_context)
    check_call(op, q, initial_state, output_final_state)
    return call.cu_seqlens, call


def _prepare_beta(beta, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise UnsupportedConfigError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True` (as in FLA).")
    if not use_beta_sigmoid_in_kernel:
        return beta
    return beta_activation(beta.to(compute_dtype(beta)), allow_neg_eigval)


def _check_gate_params(A_log, dt_bias, a_numel: int, bias_numel: int, need_a: bool):
    for name, p in (("A_log", A_log), ("dt_bias", dt_bias)):
        if p is not None and not (isinstance(p, torch.Tensor) and p.is_floating_point()):
            raise InputValidationError(f"`{name}` must be a floating-point torch.Tensor, got {type(p).__name__}.")
    if not torch.compiler.is_compiling():
        # A value check here would break the compiled graph; there, the gate these parameters make is
        # checked inside the core's boundary (a NaN in either reaches it).
        check_finite(A_log=A_log, dt_bias=dt_bias)
    if A_log is None and need_a:
        raise UnsupportedConfigError("`use_gate_in_kernel=True` needs `A_log` (or a `lower_bound` for KDA/GDN2).")
    if A_log is not None and A_log.numel() != a_numel:
        raise InputValidationError(f"`A_log` must have {a_numel} elements (one per head), got shape {list(A_log.shape)}.")
    if dt_bias is not None and dt_bias.numel() != bias_numel:
        raise InputValidationError(f"`dt_bias` must have {bias_numel} elements, got shape {list(dt_bias.shape)}.")


def _vector_gate(g, use_gate_in_kernel, safe_gate, lower_bound, A_log, dt_bias, heads: int, K: int):
    """KDA/GDN2 gate. ``lower_bound`` only shapes the in-kernel activation, as in
    FLA; ``safe_gate`` selects a faster FLA kernel and changes no math here (the
    torch backend is exact for any non-positive gates)."""
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
        raise UnsupportedConfigError(
            f"`safe_gate=True` with `use_gate_in_kernel=True` needs `lower_bound` in [-5, 0), got {lower_bound}."
        )
    if not use_gate_in_kernel:
        return g
    _check_gate_params(A_log, dt_bias, heads, heads * K, need_a=lower_bound is None)
    return vector_gate(g, A_log, dt_bias, lower_bound, compute_dtype(g))


def triton_unsupported_reason(q: torch.Tensor) -> str | None:
    """Why the Triton backend cannot serve this call, or None if it can."""
    if q.dtype == torch.float64:
        return "float64 inputs (Triton has no float64 matrix product)"
    if q.shape[-1] > 256:
        return f"key head dim {q.shape[-1]} > 256"
    return None


def _common(op, q, k, v, scale, initial_state, cu_seqlens, state_v_first, backend, policy, extras, allow_gva):
    B, T, H, K, HV, V = check_qkv(q, k, v, allow_gva)
    check_chunk_size(extras.get("chunk_size", 64))
    N = check_cu_seqlens(cu_seqlens, B)
    check_initial_state(initial_state, N, HV, K, V, state_v_first, compute_dtype(q) == torch.float64)
    reason = triton_unsupported_reason(q)
    chosen = resolve_backend(backend, q.device, reason)
    if chosen == "torch" and q.is_cuda and op not in _WARNED_TORCH_ON_GPU and not torch.compiler.is_compiling():
        _WARNED_TORCH_ON_GPU.add(op)
        warnings.warn(f"rewy-hf: {op} runs on the torch backend on GPU ({reason or 'backend=torch'}); it computes "
                      "the same gradients but is slower than FLA's kernels.", RuntimeWarning, stacklevel=3)
    _LAST.backend = chosen
    policy = resolve_policy(policy, bool(extras.get("disable_recompute", False)))
    scale = K ** -0.5 if scale is None else check_scale(scale)
    return (B, T, H, K, HV, V), scale, policy, chosen


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    backend: str = "auto",
    policy: str | None = None,
    **kwargs,
):
    """DeltaNet: S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]. Returns (o, final_state).
    """
    # DeltaNet has no state_v_first in FLA, so its deprecated alias is refused too.
    extras = pop_fla_extras("chunk_delta_rule", kwargs, tuple(k for k in _PLUMBING if k != "transpose_state_layout"))
    (B, T, H, K, HV, V), scale, policy, chosen = _common(
        "chunk_delta_rule", q, k, v, scale, initial_state, cu_seqlens, False, backend, policy, extras, allow_gva=False
    )
    check_tensor("beta", beta, 3)
    check_shape("beta", beta, (B, T, HV), "[B, T, H]")
    return _run("delta_rule", chosen, q, k, v, None, beta, None, scale, initial_state, output_final_state,
                cu_seqlens, False, policy, use_qk_l2norm_in_kernel)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    *,
    backend: str = "auto",
    policy: str | None = None,
    **kwargs,
):
    """Gated DeltaNet with a scalar log-gate per value head.

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H: GVA); g, beta:
    [B, T, HV]. With ``use_gate_in_kernel=True``, g is raw and the gate is
    ``-exp(A_log) * softplus(g + dt_bias)`` (A_log, dt_bias: [HV]).
    Under ``backend="auto"`` on a GPU with ``flash-qla`` installed, a call FlashQLA serves runs on
    its kernels, faster there at every shape measured (kernels/flash_qla_route.py).
    """
    cu_seqlens, cp_context = _cp_split("chunk_gated_delta_rule", cp_context, q, initial_state, output_final_state,
                                      cu_seqlens)
    extras = pop_fla_extras("chunk_gated_delta_rule", kwargs, _PLUMBING + ("use_gate_in_kernel", "A_log", "dt_bias"))
    state_v_first = _state_layout(state_v_first, extras)
    (B, T, H, K, HV, V), scale, policy, chosen = _common(
        "chunk_gated_delta_rule", q, k, v, scale, initial_state, cu_seqlens, state_v_first, backend, policy, extras,
        allow_gva=True,
    )
    for name, x in (("g", g), ("beta", beta)):
        check_tensor(name, x, 3)
        check_shape(name, x, (B, T, HV), "[B, T, HV]")
    if extras.get("use_gate_in_kernel", False):
        A_log, dt_bias = extras.get("A_log"), extras.get("dt_bias")
        _check_gate_params(A_log, dt_bias, HV, HV, need_a=True)
        g = scalar_gate(g, A_log, dt_bias, compute_dtype(g))
    beta = _prepare_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    why = ""
    if backend == "auto" and chosen == "triton":
        # A peer may be faster for this call: FlashQLA, where it is installed and serves it.
        from .kernels.flash_qla_route import choose

        chosen, why = choose(q, k, v, allow_neg_eigval)
        _LAST.backend = chosen
    return _run("gdn", chosen, q, k, v, g, beta, None, scale, initial_state, output_final_state, cu_seqlens,
                state_v_first, policy, use_qk_l2norm_in_kernel, why=why, cp_context=cp_context)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    backend: str = "auto",
    policy: str | None = None,
    **kwargs,
):
    """Kimi Delta Attention: per-channel log-gate g [B, T, HV, K], scalar beta [B, T, HV].

    q, k: [B, T, H, K]; v: [B, T, HV, V] (GVA when HV > H). With
    ``use_gate_in_kernel=True`` the gate is ``-exp(A_log) * softplus(g + dt_bias)``
    or, with ``lower_bound``, ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
    """
    for name, value, default in (("return_intermediate_states", return_intermediate_states, False),
                                 ("use_graph", use_graph, False)):
        refuse_if_set("chunk_kda", name, value, default)
    cu_seqlens, cp_context = _cp_split("chunk_kda", cp_context, q, initial_state, output_final_state,
                                      cu_seqlens)
    extras = pop_fla_extras("chunk_kda", kwargs, _PLUMBING + ("A_log", "dt_bias"))
    extras["disable_recompute"] = disable_recompute
    state_v_first = _state_layout(state_v_first, extras)
    (B, T, H, K, HV, V), scale, policy, chosen = _common(
        "chunk_kda", q, k, v, scale, initial_state, cu_seqlens, state_v_first, backend, policy, extras, allow_gva=True
    )
    check_tensor("g", g, 4)
    check_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    check_tensor("beta", beta, 3)
    check_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    g = _vector_gate(g, use_gate_in_kernel, safe_gate, lower_bound, extras.get("A_log"), extras.get("dt_bias"), HV, K)
    beta = _prepare_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run("kda", chosen, q, k, v, g, beta, None, scale, initial_state, output_final_state, cu_seqlens,
                state_v_first, policy, use_qk_l2norm_in_kernel, safe_gate, cp_context=cp_context)


def chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cp_context=None,
    *,
    backend: str = "auto",
    policy: str | None = None,
    **kwargs,
):
    """Gated DeltaNet-2: channel-wise erase gate b [B, T, H, K] and write gate w [B, T, H, V].

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T with
    g [B, T, H, K]. No GVA (as in FLA 0.6.0).
    """
    refuse_if_set("chunk_gdn2", "return_intermediate_states", return_intermediate_states, False)
    cu_seqlens, cp_context = _cp_split("chunk_gdn2", cp_context, q, initial_state, output_final_state,
                                      cu_seqlens)
    extras = pop_fla_extras("chunk_gdn2", kwargs, _PLUMBING + ("A_log", "dt_bias"))
    extras["disable_recompute"] = disable_recompute
    state_v_first = _state_layout(state_v_first, extras)
    (B, T, H, K, HV, V), scale, policy, chosen = _common(
        "chunk_gdn2", q, k, v, scale, initial_state, cu_seqlens, state_v_first, backend, policy, extras, allow_gva=False
    )
    for name, x, shape, meaning in (("g", g, (B, T, H, K), "[B, T, H, K]"), ("b", b, (B, T, H, K), "[B, T, H, K]"),
                                    ("w", w, (B, T, H, V), "[B, T, H, V]")):
        check_tensor(name, x, 4)
        check_shape(name, x, shape, meaning)
    g = _vector_gate(g, use_gate_in_kernel, safe_gate, lower_bound, extras.get("A_log"), extras.get("dt_bias"), H, K)
    return _run("gdn2", chosen, q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens,
                state_v_first, policy, use_qk_l2norm_in_kernel, safe_gate, cp_context=cp_context)
