"""Public delta-rule ops with FLA 0.6.0's names, argument order and return value.

Each op validates its inputs, applies the activations FLA fuses into its
kernels (q/k l2norm, gate and beta activations) as torch ops (the gate as one
autograd node that keeps its raw input, kernels/gate_activation.py), and
hands the activated tensors to the selected backend, whose autograd Function
runs the chunked forward and the ReWY backward. Extra keyword arguments:
``backend`` ("auto", "torch", "triton") and ``policy`` ("recompute", "full";
FLA's ``disable_recompute=True`` means "full").

The four ops share one implementation (``_run_op``); what differs between
them is written once per op in ``SPECS``: the tensors after q, k and v and
their shapes, whether value heads may outnumber key heads (GVA), the FLA
keywords each accepts or refuses. The public functions only spell FLA's
signatures.

Two per-thread values travel beside the calls: ``last_backend()``, the backend
that served this thread's latest op call (for callers that run the ops
directly, such as `rewy-hf bench`; a patched model's calls are counted in
``rewy_hf.dispatch_report()``), and ``reporting_as(op)``, the op name under
which the calls made inside it are counted in that report (the dispatcher
wraps the calls of patched layers in it).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import InputValidationError, UnsupportedConfigError
from .kernels.core import CoreArgs, delta_rule
from .kernels.gate_activation import scalar_gate, vector_gate
from .kernels.reference import beta_activation, l2norm
from .kernels.torch_backend import compute_dtype
from .kernels.vocabulary import FAMILIES, PUBLIC_OPS, gate_kind
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


class _CallState(threading.local):
    """Per thread: the backend that served the latest op call, and the op name the dispatch report
    counts calls under. A thread-local rather than a ContextVar: torch.compile traces attribute
    access on it."""

    # Both attributes exist from each thread's first access on: a traced read of a missing one
    # would be a guard that recompiles once the first call sets it.
    def __init__(self):
        self.backend: str | None = None
        self.report_as = ""


_STATE = _CallState()


def last_backend() -> str | None:
    """The backend ("torch", "triton" or "flash_qla") that served this thread's latest call of one of
    the ops here, or None before the first; what `rewy-hf bench` records for each call it checks."""
    return _STATE.backend


def reporting_as(op: str):
    """Calls made inside ``with reporting_as(op):`` have their forward and backward counted in the
    dispatch report as ``op`` (the dispatcher wraps the calls of patched layers)."""
    return _Reporting(op)


class _Reporting:
    # A plain class (not contextlib.contextmanager): dynamo traces its __enter__ / __exit__.
    def __init__(self, op: str):
        self.op = op

    def __enter__(self):
        self.previous = _STATE.report_as
        _STATE.report_as = self.op

    def __exit__(self, *exc):
        _STATE.report_as = self.previous


_WARNED_TORCH_ON_GPU: set[str] = set()


# --- what differs between the ops ----------------------------------------------------------------

class Input(NamedTuple):
    """One of an op's tensors after q, k and v."""

    argument: str                # the op's argument name
    field: str                   # the CoreArgs field it becomes (GDN2's erase gate ``b`` is the core's beta)
    dims: tuple[str, ...]        # its shape, in the sizes B, T, H, K, HV, V of q, k and v
    shape_text: str              # the shape as error messages spell it


@dataclass(frozen=True)
class OpSpec:
    """What one public op takes, beyond the arguments all four share."""

    family: str                  # the delta-rule family (kernels/vocabulary.py)
    name: str                    # the public op, as FLA names it
    gate_kind: str               # "none", "scalar" or "vector": how the in-kernel gate is formed
    inputs: tuple[Input, ...]    # its tensors after q, k and v, in argument order
    gva: bool                    # value heads may outnumber key heads
    extras: tuple[str, ...]      # FLA keywords taken through **kwargs
    refused: tuple[str, ...]     # FLA arguments refused unless left at False
    beta_activation: bool        # has use_beta_sigmoid_in_kernel / allow_neg_eigval
    flash_qla: bool              # backend="auto" may send its calls to FlashQLA (kernels/flash_qla_route.py)


def _spec(family: str, inputs: tuple[Input, ...], *, gva: bool, extras: tuple[str, ...], refused: tuple[str, ...] = (),
          beta_activation: bool = False, flash_qla: bool = False) -> OpSpec:
    return OpSpec(family, PUBLIC_OPS[family], gate_kind(family), inputs, gva, extras, refused, beta_activation,
                  flash_qla)


# FLA's plumbing keywords: they change nothing here (chunk_size must be 64; disable_recompute is
# policy="full"; transpose_state_layout is the deprecated name of state_v_first).
_PLUMBING = ("chunk_size", "chunk_indices", "cu_seqlens_cpu", "transpose_state_layout", "disable_recompute")
_PER_HEAD = ("B", "T", "HV")

SPECS: dict[str, OpSpec] = {s.family: s for s in (
    # DeltaNet has no state_v_first in FLA, so its deprecated alias is refused too.
    _spec("delta_rule", (Input("beta", "beta", _PER_HEAD, "[B, T, H]"),), gva=False,
          extras=tuple(k for k in _PLUMBING if k != "transpose_state_layout")),
    _spec("gdn", (Input("g", "g", _PER_HEAD, "[B, T, HV]"), Input("beta", "beta", _PER_HEAD, "[B, T, HV]")),
          gva=True, extras=_PLUMBING + ("use_gate_in_kernel", "A_log", "dt_bias"), beta_activation=True,
          flash_qla=True),
    _spec("kda", (Input("g", "g", ("B", "T", "HV", "K"), "[B, T, HV, K]"),
                  Input("beta", "beta", _PER_HEAD, "[B, T, HV]")),
          gva=True, extras=_PLUMBING + ("A_log", "dt_bias"), refused=("return_intermediate_states", "use_graph"),
          beta_activation=True),
    _spec("gdn2", (Input("g", "g", ("B", "T", "H", "K"), "[B, T, H, K]"),
                   Input("b", "beta", ("B", "T", "H", "K"), "[B, T, H, K]"),
                   Input("w", "w", ("B", "T", "H", "V"), "[B, T, H, V]")),
          gva=False, extras=_PLUMBING + ("A_log", "dt_bias"), refused=("return_intermediate_states",)),
)}
assert tuple(SPECS) == FAMILIES

# FLA's defaults of the options some ops have and others lack (an op without one runs as with its default).
_FLA_DEFAULTS = dict(state_v_first=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                     allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False, A_log=None,
                     dt_bias=None, chunk_size=64)


# --- the shared implementation --------------------------------------------------------------------

def _run_op(spec: OpSpec, q, k, v, tensors: dict, given: dict, *, scale, initial_state, output_final_state: bool,
            qk_l2norm: bool, cu_seqlens, backend: str, policy: str | None, kwargs: dict):
    """One call of ``spec``'s op: ``tensors`` are its inputs after q, k, v by argument name,
    ``given`` the FLA arguments its signature names beyond those all four share, ``kwargs`` its
    leftover keywords. (Two dicts rather than ``**given``: collecting keywords costs host time on
    every eager call.)"""
    op = spec.name
    for name in spec.refused:
        refuse_if_set(op, name, given.pop(name), False)
    cu_seqlens, cp_call = _cp_split(op, given.pop("cp_context", None), q, initial_state, output_final_state,
                                    cu_seqlens)
    options = {**_FLA_DEFAULTS, **pop_fla_extras(op, kwargs, spec.extras), **given}
    state_v_first = _state_layout(options["state_v_first"], options)
    (B, T, H, K, HV, V), scale, policy, chosen = _common(
        op, q, k, v, scale, initial_state, cu_seqlens, state_v_first, backend, policy, options, spec.gva)
    sizes = dict(B=B, T=T, H=H, K=K, HV=HV, V=V)
    for x in spec.inputs:
        check_tensor(x.argument, tensors[x.argument], len(x.dims))
        check_shape(x.argument, tensors[x.argument], tuple([sizes[d] for d in x.dims]), x.shape_text)
    core = {x.field: tensors[x.argument] for x in spec.inputs}
    g, beta = core.get("g"), core["beta"]
    if spec.gate_kind == "scalar" and options["use_gate_in_kernel"]:
        _check_gate_params(options["A_log"], options["dt_bias"], HV, HV, need_a=True)
        g = scalar_gate(g, options["A_log"], options["dt_bias"], compute_dtype(g))
    elif spec.gate_kind == "vector":
        g = _vector_gate(g, options["use_gate_in_kernel"], options["safe_gate"], options["lower_bound"],
                         options["A_log"], options["dt_bias"], HV, K)
    if spec.beta_activation:
        beta = _prepare_beta(beta, options["use_beta_sigmoid_in_kernel"], options["allow_neg_eigval"])
    why = ""
    if spec.flash_qla and backend == "auto" and chosen == "triton":
        # A peer may be faster for this call: FlashQLA, where it is installed and serves it.
        from .kernels.flash_qla_route import choose

        chosen, why = choose(q, k, v, options["allow_neg_eigval"])
        _STATE.backend = chosen
    if chosen == "torch" and qk_l2norm:
        # The torch backend takes q and k normalised (in float32, float64 staying float64, as plain
        # torch ops autograd chains through); the others normalise inside the core
        # (kernels/triton_backend/qk_l2norm.py).
        dt = compute_dtype(q)
        q, k, qk_l2norm = l2norm(q.to(dt)), l2norm(k.to(dt)), False
    a = CoreArgs(q=q, k=k, v=v, g=g, beta=beta, w=core.get("w"), h0=initial_state, cu_seqlens=cu_seqlens,
                 scale=scale, family=spec.family, policy=policy, state_v_first=state_v_first, qk_l2norm=qk_l2norm,
                 safe_gate=options["safe_gate"], report_as=_STATE.report_as, why=why)
    if cp_call is not None:
        from .kernels.context_parallel import cp_delta_rule

        return cp_delta_rule(a, chosen, cp_call), None
    return delta_rule(a, chosen, final_state=output_final_state)


def _state_layout(state_v_first: bool, options: dict) -> bool:
    if "transpose_state_layout" not in options:
        return state_v_first
    if state_v_first:
        raise UnsupportedConfigError("pass either `state_v_first` or the deprecated `transpose_state_layout`, not both.")
    # stacklevel: the user's call, past _run_op and the public op.
    warnings.warn("`transpose_state_layout` is deprecated; use `state_v_first`.", DeprecationWarning, stacklevel=4)
    return bool(options["transpose_state_layout"])


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


def _common(op, q, k, v, scale, initial_state, cu_seqlens, state_v_first, backend, policy, options, allow_gva):
    B, T, H, K, HV, V = check_qkv(q, k, v, allow_gva)
    check_chunk_size(options["chunk_size"])
    N = check_cu_seqlens(cu_seqlens, B)
    check_initial_state(initial_state, N, HV, K, V, state_v_first, compute_dtype(q) == torch.float64)
    reason = triton_unsupported_reason(q)
    chosen = resolve_backend(backend, q.device, reason)
    if chosen == "torch" and q.is_cuda and op not in _WARNED_TORCH_ON_GPU and not torch.compiler.is_compiling():
        _WARNED_TORCH_ON_GPU.add(op)
        # stacklevel: the user's call, past _run_op and the public op.
        warnings.warn(f"rewy-hf: {op} runs on the torch backend on GPU ({reason or 'backend=torch'}); it computes "
                      "the same gradients but is slower than FLA's kernels.", RuntimeWarning, stacklevel=4)
    _STATE.backend = chosen
    policy = resolve_policy(policy, bool(options["disable_recompute"]))
    scale = K ** -0.5 if scale is None else check_scale(scale)
    return (B, T, H, K, HV, V), scale, policy, chosen


# --- the public ops: FLA 0.6.0's signatures ------------------------------------------------------

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
    return _run_op(SPECS["delta_rule"], q, k, v, {"beta": beta}, {}, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                   backend=backend, policy=policy, kwargs=kwargs)


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
    given = {"use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel, "allow_neg_eigval": allow_neg_eigval,
             "state_v_first": state_v_first, "cp_context": cp_context}
    return _run_op(SPECS["gdn"], q, k, v, {"g": g, "beta": beta}, given, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                   backend=backend, policy=policy, kwargs=kwargs)


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
    given = {"use_gate_in_kernel": use_gate_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
             "allow_neg_eigval": allow_neg_eigval, "safe_gate": safe_gate, "lower_bound": lower_bound,
             "disable_recompute": disable_recompute, "return_intermediate_states": return_intermediate_states,
             "state_v_first": state_v_first, "cp_context": cp_context, "use_graph": use_graph}
    return _run_op(SPECS["kda"], q, k, v, {"g": g, "beta": beta}, given, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                   backend=backend, policy=policy, kwargs=kwargs)


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
    given = {"use_gate_in_kernel": use_gate_in_kernel, "safe_gate": safe_gate, "lower_bound": lower_bound,
             "disable_recompute": disable_recompute, "return_intermediate_states": return_intermediate_states,
             "state_v_first": state_v_first, "cp_context": cp_context}
    return _run_op(SPECS["gdn2"], q, k, v, {"g": g, "b": b, "w": w}, given, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                   backend=backend, policy=policy, kwargs=kwargs)
