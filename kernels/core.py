"""The autograd boundary of the delta-rule core: one for both backends, eager or compiled.

``delta_rule(args, backend)`` runs a backend's forward (torch_backend or
triton_backend: each has ``forward``, ``backward`` and ``saved_like``) and
registers its backward, in one of two equivalent ways:

- eagerly, through ``CoreFunction`` (a ``torch.autograd.Function``);
- under ``torch.compile``, through the custom op ``torch.ops.rewy.delta_rule``
  with its fake implementation and registered autograd (the backward is the
  custom op ``torch.ops.rewy.delta_rule_backward``). Dynamo records both as
  single nodes, so a delta-rule layer compiles without a graph break, and the
  fake implementations give shapes from the input shapes alone (sizes that
  depend on packed lengths are unbacked), so new lengths do not recompile.

Both paths run the same backend functions and save the same tensors: the
inputs, and the intermediates the backend's forward returns. Eagerly, two
inputs are kept in a leaner form: one that is a view into a larger buffer
(transformers' q, k and v are views of one convolution output) as a dense
copy (``_compact``), and the gate, for a backend whose backward reads only
its dtype, as a one-element stand-in (``_stand_in``). Under compile
AOTAutograd's partitioner chooses what the backward keeps: for views of a
SiLU output it keeps the SiLU's input, which that backward needs anyway,
and recomputes the views, and with inductor it recomputes a gate made by
pointwise ops from what their own backward keeps (checked on the CPU; a
stand-in there would save nothing). Eager calls skip
the custom op because its dispatch costs host time on every call (about
0.35 ms per forward + backward on a 2-core CPU, against 0.15 ms for the
Function), which the GPU does not hide at the smaller benchmark shapes.

A call made by a patched layer carries ``report_as``, its op name in the
dispatch report; each forward and backward of such a call is announced to
``LISTENERS`` from inside the boundary itself (eager Function or custom op
alike). A compiled graph runs the custom op on every call, so the counts are
right there too, and the traced code never reads a counter (dynamo would
guard on its value and recompile at every step).

Checks that read tensor values (packed bounds, the opt-in finite check) run
here, inside the boundary, so the traced code around the core never reads a
tensor's values.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .core_args import FAMILIES, CoreArgs

__all__ = ["CoreArgs", "delta_rule", "CoreFunction"]

BACKENDS = ("torch", "triton", "flash_qla")
# Called as listener(event, report_as, backend, policy, why), event "forward" or "backward", after
# each forward and backward of a call that has a ``report_as`` (the dispatch report counts them).
LISTENERS: list[Callable[[str, str, str, str, str], None]] = []


def _backend(name: str):
    # Imported on first use: importing rewy_hf must not define Triton kernels.
    if name == "torch":
        from . import torch_backend as module
    elif name == "triton":
        from . import triton_backend as module
    elif name == "flash_qla":
        from . import flash_qla_backend as module
    else:
        raise ValueError(f"unknown core backend {name!r}; expected one of {BACKENDS}")
    return module


def _check_values(a: CoreArgs) -> None:
    from ..validation import check_cu_seqlens_values, check_finite

    check_cu_seqlens_values(a.cu_seqlens, a.q.shape[1])
    gates = dict(b=a.beta, w=a.w) if a.family == "gdn2" else dict(beta=a.beta)     # the op's argument names
    check_finite(reset_gate="g", q=a.q, k=a.k, v=a.v, g=a.g, **gates, initial_state=a.h0)


def _settings(a: CoreArgs) -> tuple:
    return a.scale, a.family, a.policy, a.state_v_first, a.qk_l2norm, a.safe_gate, a.report_as, a.why


def _announce(event: str, a: CoreArgs, backend: str) -> None:
    if a.report_as:
        for listener in LISTENERS:
            listener(event, a.report_as, backend, a.policy, a.why)


def _tensors(a: CoreArgs) -> tuple:
    return a.q, a.k, a.v, a.g, a.beta, a.w, a.h0, a.cu_seqlens


def _kept(a: CoreArgs, backend: str) -> tuple:
    """The inputs the backward keeps: all but q and k when the backend saved them normalised (one
    copy of each per layer instead of two; the backward takes the normalised ones in their place,
    same shape and dtype)."""
    if _backend(backend).normalised_qk(a) is not None:
        return (None, None) + _tensors(a)[2:]
    return _tensors(a)


def _restored(inputs: tuple, a_settings: tuple, backend: str, saved: list) -> tuple:
    q, k, *rest = inputs
    if q is None:
        iq, ik = _backend(backend).normalised_qk(CoreArgs(None, None, *rest, *a_settings))
        q, k = saved[iq], saved[ik]
    return (q, k, *rest)


def delta_rule(a: CoreArgs, backend: str) -> tuple[Tensor, Tensor]:
    """(o [B, T, HV, V] in v's dtype, the final state [N, HV, K, V] float32 in the caller's layout).
    The final state is always returned; a caller that did not ask for it drops it, and its
    gradient is then absent."""
    if a.family not in FAMILIES:
        raise ValueError(f"unknown delta-rule family {a.family!r}; expected one of {FAMILIES}")
    if torch.compiler.is_compiling():
        out = torch.ops.rewy.delta_rule(*_tensors(a), *_settings(a), backend)
        return out[0], out[1]
    return CoreFunction.apply(*_tensors(a), _settings(a), backend)


class CoreFunction(torch.autograd.Function):
    """The eager path: o, ht = f(q, k, v, g, beta, w, h0) for ``backend``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, w, h0, cu_seqlens, settings: tuple, backend: str):
        ctx.set_materialize_grads(False)       # no zero tensors for an unused output or final state
        a = CoreArgs(*map(_compact, (q, k, v, g, beta, w)), h0, cu_seqlens, *settings)
        _check_values(a)
        o, ht, saved = _backend(backend).forward(a)
        _announce("forward", a, backend)
        kept = list(_kept(a, backend))
        if a.g is not None and not _backend(backend).BACKWARD_READS_GATE:
            kept[3] = _stand_in(a.g)
        ctx.save_for_backward(*kept, *saved)
        ctx.settings, ctx.backend = settings, backend
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        if torch.is_grad_enabled():
            from ..errors import UnsupportedConfigError

            raise UnsupportedConfigError(
                "double backward (a gradient with create_graph=True) through rewy's delta-rule core is not "
                "supported: its backward is written by hand and is not itself differentiable. Take first-order "
                "gradients, or unpatch the model for this computation.")
        # Read once: under non-reentrant activation checkpointing every read of saved_tensors
        # unpacks (recomputes) them, and a second read is refused.
        stored = ctx.saved_tensors
        inputs, saved = stored[:8], list(stored[8:])
        a = CoreArgs(*_restored(inputs, ctx.settings, ctx.backend, saved), *ctx.settings)
        do = torch.zeros_like(a.v) if do is None else do
        grads = _backend(ctx.backend).backward(a, saved, do, dht)
        _announce("backward", a, ctx.backend)
        return (*grads, None, None, None)


# The custom ops. Their signatures spell out CoreArgs' fields, as torch.library needs.

@torch.library.custom_op("rewy::delta_rule", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, w: Tensor | None,
                h0: Tensor | None, cu_seqlens: Tensor | None, scale: float, family: str, policy: str,
                state_v_first: bool, qk_l2norm: bool, safe_gate: bool, report_as: str, why: str,
                backend: str) -> list[Tensor]:
    a = CoreArgs(q, k, v, g, beta, w, h0, cu_seqlens, scale, family, policy, state_v_first, qk_l2norm, safe_gate,
                 report_as, why)
    _check_values(a)
    o, ht, saved = _backend(backend).forward(a)
    _announce("forward", a, backend)
    return [_own(x) for x in (o, ht, *saved)]


@_forward_op.register_fake
def _forward_fake(q, k, v, g, beta, w, h0, cu_seqlens, scale, family, policy, state_v_first, qk_l2norm, safe_gate,
                  report_as, why, backend):
    a = CoreArgs(q, k, v, g, beta, w, h0, cu_seqlens, scale, family, policy, state_v_first, qk_l2norm, safe_gate)
    ctx = torch.library.get_ctx()
    state_dtype = torch.float64 if backend == "torch" and q.dtype == torch.float64 else torch.float32
    o = v.new_empty(v.shape)
    ht = q.new_empty(a.state_shape(), dtype=state_dtype)
    return [o, ht, *_backend(backend).saved_like(a, ctx.new_dynamic_size)]


@torch.library.custom_op("rewy::delta_rule_backward", mutates_args=())
def _backward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, w: Tensor | None,
                 h0: Tensor | None, cu_seqlens: Tensor | None, saved: list[Tensor], do: Tensor, dht: Tensor | None,
                 scale: float, family: str, policy: str, state_v_first: bool, qk_l2norm: bool, safe_gate: bool,
                 report_as: str, why: str, backend: str) -> list[Tensor]:
    a = CoreArgs(q, k, v, g, beta, w, h0, cu_seqlens, scale, family, policy, state_v_first, qk_l2norm, safe_gate,
                 report_as, why)
    grads = _backend(backend).backward(a, list(saved), do, dht)
    _announce("backward", a, backend)
    return [_own(x) for x in grads if x is not None]


@_backward_op.register_fake
def _backward_fake(q, k, v, g, beta, w, h0, cu_seqlens, saved, do, dht, *settings):
    return [x.new_empty(x.shape) for x in (q, k, v, g, beta, w, h0) if x is not None]


def _compact(x: Tensor | None) -> Tensor | None:
    """``x``, or a dense copy of it where ``x`` is a view into a larger buffer. The backward keeps its
    inputs, and a kept view keeps its whole buffer alive: transformers' q, k and v are views of one
    convolution output, so keeping v kept all three (in a Qwen3.5-like layer with 16 key and 32 value
    heads of 128, twice v's size). The Triton and FlashQLA backends copy such inputs dense for their
    kernels anyway; the copy is made here once, and it is the one kept."""
    if x is None or (x.is_contiguous() and x.untyped_storage().nbytes() == x.numel() * x.element_size()):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _stand_in(x: Tensor) -> Tensor:
    """A tensor of ``x``'s shape and dtype over one element of storage, kept in place of an input whose
    values the backward does not read. The Triton and FlashQLA backwards work from the gate's chunk
    cumsum their forwards saved and read only the gate's dtype: keeping the gate itself would hold a
    float32 [B, T, HV, K] tensor per KDA / GDN2 layer (64 MB at B x T = 8192, 16 heads of 128)."""
    return x.new_empty(()).expand(x.shape)


def _own(x: Tensor) -> Tensor:
    """A dense tensor that owns its storage: the fake implementations describe dense tensors, and
    AOTAutograd mishandles an output that is a view into a larger buffer (the torch backend's
    chunk states are a slice of the recurrence's buffer)."""
    return x.clone(memory_format=torch.contiguous_format) if x._base is not None or not x.is_contiguous() else x


def _setup_context(ctx, inputs, output):
    a = CoreArgs(*inputs[:-1])
    ctx.save_for_backward(*_kept(a, inputs[-1]), *output[2:])
    ctx.settings = inputs[8:]


def _backward(ctx, grads):
    stored = ctx.saved_tensors                 # read once, as in CoreFunction.backward
    inputs, saved = stored[:8], list(stored[8:])
    q, k, v, g, beta, w, h0, cu_seqlens = _restored(inputs, ctx.settings[:-1], ctx.settings[-1], saved)
    do, dht = grads[0], grads[1]
    do = torch.zeros_like(v) if do is None else do
    out = iter(torch.ops.rewy.delta_rule_backward(q, k, v, g, beta, w, h0, cu_seqlens, saved, do, dht,
                                                   *ctx.settings))
    dq, dk, dv, dg, dbeta, dw, dh0 = (None if x is None else next(out) for x in (q, k, v, g, beta, w, h0))
    return (dq, dk, dv, dg, dbeta, dw, dh0, None) + (None,) * len(ctx.settings)


_forward_op.register_autograd(_backward, setup_context=_setup_context)
