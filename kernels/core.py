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
the listeners registered with ``add_listener`` (a ``CoreListener``: the
dispatch report's counter, rewy_hf/patching/dispatch.py) from inside the
boundary itself (eager Function or custom op alike). A compiled graph runs the
custom op on every call, so the counts are right there too, and the traced
code never reads a counter (dynamo would guard on its value and recompile at
every step).

The custom ops take ``CoreArgs`` flattened (core_args.py) and spell its
fields out in their signatures, as torch.library needs; ``_spelled_as`` checks
each signature against the dataclass's fields at import, so the two cannot
drift apart.

Checks that read tensor values (packed bounds, the opt-in finite check) run
here, inside the boundary, so the traced code around the core never reads a
tensor's values.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from typing import Callable, Protocol

import torch
from torch import Tensor

from .core_args import GRADIENT_FIELDS, SETTING_FIELDS, TENSOR_FIELDS, CoreArgs, gradients_by_field
from .errors import UnsupportedConfigError
from .value_checks import check_cu_seqlens_values, check_finite
from .vocabulary import CORE_BACKENDS, FAMILIES

__all__ = ["CoreArgs", "CoreFunction", "CoreListener", "add_listener", "delta_rule", "remove_listener"]


class CoreListener(Protocol):
    """Told of each forward and backward of a core call that has a ``report_as`` (``op``), with the
    backend that ran it, the call's policy and, where ``backend="auto"`` weighed a peer, why."""

    def forward(self, op: str, backend: str, policy: str, why: str) -> None: ...

    def backward(self, op: str, backend: str, policy: str, why: str) -> None: ...


# Replaced, never mutated, so a forward announcing on one thread while another registers sees a
# consistent tuple.
_listeners: tuple[CoreListener, ...] = ()


def add_listener(listener: CoreListener) -> None:
    """Announce every reported forward and backward to ``listener`` (once, however often added)."""
    global _listeners
    missing = [m for m in ("forward", "backward") if not callable(getattr(listener, m, None))]
    if missing:
        raise TypeError(f"a core listener needs forward() and backward() methods; {listener!r} lacks {missing}")
    if listener not in _listeners:
        _listeners = _listeners + (listener,)


def remove_listener(listener: CoreListener) -> None:
    """Stop announcing to ``listener`` (nothing happens if it was not added)."""
    global _listeners
    _listeners = tuple(x for x in _listeners if x is not listener)


def _announce_forward(a: CoreArgs, backend: str) -> None:
    if a.report_as:
        for listener in _listeners:
            listener.forward(a.report_as, backend, a.policy, a.why)


def _announce_backward(a: CoreArgs, backend: str) -> None:
    if a.report_as:
        for listener in _listeners:
            listener.backward(a.report_as, backend, a.policy, a.why)


def _backend(name: str):
    # Imported on first use: importing rewy_hf must not define Triton kernels.
    if name == "torch":
        from . import torch_backend as module
    elif name == "triton":
        from . import triton_backend as module
    elif name == "flash_qla":
        from . import flash_qla_backend as module
    else:
        raise ValueError(f"unknown core backend {name!r}; expected one of {CORE_BACKENDS}")
    return module


def _check_values(a: CoreArgs) -> None:
    check_cu_seqlens_values(a.cu_seqlens, a.q.shape[1])
    gates = dict(b=a.beta, w=a.w) if a.family == "gdn2" else dict(beta=a.beta)     # the op's argument names
    check_finite(reset_gate="g", q=a.q, k=a.k, v=a.v, g=a.g, **gates, initial_state=a.h0)


def _kept(a: CoreArgs, backend: str) -> tuple:
    """The inputs the backward keeps: all but q and k when the backend saved them normalised (one
    copy of each per layer instead of two; the backward takes the normalised ones in their place,
    same shape and dtype)."""
    if _backend(backend).normalised_qk(a) is not None:
        return replace(a, q=None, k=None).tensors()
    return a.tensors()


def _restored(kept: tuple, settings: tuple, backend: str, saved: list) -> CoreArgs:
    """The call's record from what ``_kept`` kept, q and k taken from ``saved`` where they were left out."""
    a = CoreArgs.from_flat(kept, settings)
    if a.q is None:
        iq, ik = _backend(backend).normalised_qk(a)
        a = replace(a, q=saved[iq], k=saved[ik])
    return a


def delta_rule(a: CoreArgs, backend: str, final_state: bool = True) -> tuple[Tensor, Tensor | None]:
    """(o [B, T, HV, V] in v's dtype, the final state [N, HV, K, V] float32 in the caller's layout,
    or None where ``final_state`` is False; its gradient is then absent)."""
    if a.family not in FAMILIES:
        raise ValueError(f"unknown delta-rule family {a.family!r}; expected one of {FAMILIES}")
    if torch.compiler.is_compiling():
        out = torch.ops.rewy.delta_rule(*a.tensors(), *a.settings(), backend)
        # The op returns the state flat (_forward_fake says why); shaped only where the caller takes it.
        return out[0], out[1].view(a.state_shape()) if final_state else None
    o, ht = CoreFunction.apply(*a.tensors(), a.settings(), backend)
    return o, ht if final_state else None


# The inputs the eager path keeps as dense copies where they are views into a larger buffer (_compact).
_KEPT_DENSE = frozenset(("q", "k", "v", "g", "beta", "w"))


class CoreFunction(torch.autograd.Function):
    """The eager path: o, ht = f(q, k, v, g, beta, w, h0) for ``backend``; its arguments are
    ``CoreArgs.tensors()``, then ``CoreArgs.settings()`` as one tuple, then the backend."""

    @staticmethod
    def forward(ctx, *args):
        *tensors, settings, backend = args
        ctx.set_materialize_grads(False)       # no zero tensors for an unused output or final state
        a = CoreArgs.from_flat([_compact(x) if name in _KEPT_DENSE else x for name, x in zip(TENSOR_FIELDS, tensors)],
                               settings)
        _check_values(a)
        o, ht, saved = _backend(backend).forward(a)
        _announce_forward(a, backend)
        kept = list(_kept(a, backend))
        if a.g is not None and not _backend(backend).BACKWARD_READS_GATE:
            kept[TENSOR_FIELDS.index("g")] = _stand_in(a.g)
        ctx.save_for_backward(*kept, *saved)
        ctx.settings, ctx.backend = settings, backend
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        if torch.is_grad_enabled():
            raise UnsupportedConfigError(
                "double backward (a gradient with create_graph=True) through rewy's delta-rule core is not "
                "supported: its backward is written by hand and is not itself differentiable. Take first-order "
                "gradients, or unpatch the model for this computation.")
        # Read once: under non-reentrant activation checkpointing every read of saved_tensors
        # unpacks (recomputes) them, and a second read is refused.
        stored = ctx.saved_tensors
        n = len(TENSOR_FIELDS)
        kept, saved = stored[:n], list(stored[n:])
        a = _restored(kept, ctx.settings, ctx.backend, saved)
        do = torch.zeros_like(a.v) if do is None else do
        grads = _backend(ctx.backend).backward(a, saved, do, dht)
        _announce_backward(a, ctx.backend)
        return (*gradients_by_field(grads), None, None)


# The custom ops. Their signatures spell out CoreArgs' fields, as torch.library needs; _spelled_as
# refuses, at import, a signature that no longer matches the dataclass.

_FORWARD_PARAMETERS = TENSOR_FIELDS + SETTING_FIELDS + ("backend",)
_BACKWARD_PARAMETERS = TENSOR_FIELDS + ("saved", "do", "dht") + SETTING_FIELDS + ("backend",)


def _record(parameters: dict) -> tuple[CoreArgs, str]:
    """The call's record and backend from a custom op's parameters, passed as the ``locals()`` its
    body starts with: by name, so only the signature (checked by ``_spelled_as``) spells the fields."""
    return CoreArgs(**{name: parameters[name] for name in TENSOR_FIELDS + SETTING_FIELDS}), parameters["backend"]


def _spelled_as(parameters: tuple[str, ...]) -> Callable:
    def check(fn: Callable) -> Callable:
        spelled = tuple(inspect.signature(fn).parameters)
        if spelled != parameters:
            raise TypeError(f"{fn.__name__}'s parameters {spelled} do not follow CoreArgs' fields: expected "
                            f"{parameters} (kernels/core_args.py)")
        return fn
    return check


@torch.library.custom_op("rewy::delta_rule", mutates_args=())
@_spelled_as(_FORWARD_PARAMETERS)
def _forward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, w: Tensor | None,
                h0: Tensor | None, cu_seqlens: Tensor | None, scale: float, family: str, policy: str,
                state_v_first: bool, qk_l2norm: bool, safe_gate: bool, report_as: str, why: str,
                backend: str) -> list[Tensor]:
    a, backend = _record(locals())
    _check_values(a)
    o, ht, saved = _backend(backend).forward(a)
    _announce_forward(a, backend)
    # Flattened after _own: a view over the whole of a buffer no other output shares, not a copy of it.
    return [_own(o), _own(ht).view(-1), *(_own(x) for x in saved)]


@_forward_op.register_fake
@_spelled_as(_FORWARD_PARAMETERS)
def _forward_fake(q, k, v, g, beta, w, h0, cu_seqlens, scale, family, policy, state_v_first, qk_l2norm, safe_gate,
                  report_as, why, backend):
    a, backend = _record(locals())
    ctx = torch.library.get_ctx()
    state_dtype = torch.float64 if backend == "torch" and q.dtype == torch.float64 else torch.float32
    o = v.new_empty(v.shape)
    # The final state flat, N x HV x K x V values: shaped [N, HV, K, V], its size N of a packed call
    # (symbolic in a compiled graph) would be guarded against 1 when the trace checks contiguity, and the
    # first step whose row held one document compiled the graph again.
    ht = q.new_empty(math.prod(a.state_shape()), dtype=state_dtype)
    return [o, ht, *_backend(backend).saved_like(a, ctx.new_dynamic_size)]


@torch.library.custom_op("rewy::delta_rule_backward", mutates_args=())
@_spelled_as(_BACKWARD_PARAMETERS)
def _backward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, w: Tensor | None,
                 h0: Tensor | None, cu_seqlens: Tensor | None, saved: list[Tensor], do: Tensor, dht: Tensor | None,
                 scale: float, family: str, policy: str, state_v_first: bool, qk_l2norm: bool, safe_gate: bool,
                 report_as: str, why: str, backend: str) -> list[Tensor]:
    a, backend = _record(locals())
    # dht comes flat, as the forward op returns the state; shaped here, outside the trace (_forward_fake)
    dht = None if dht is None else dht.view(a.state_shape())
    grads = _backend(backend).backward(a, list(saved), do, dht)
    _announce_backward(a, backend)
    return [_own(x) for x in grads if x is not None]


@_backward_op.register_fake
def _backward_fake(*args):
    # One gradient per input with a gradient that is present, as _backward_op returns them.
    inputs = dict(zip(TENSOR_FIELDS, args))
    return [inputs[name].new_empty(inputs[name].shape) for name in GRADIENT_FIELDS if inputs[name] is not None]


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
    # As in CoreFunction: an unused final state gets no zero gradient. Materialised, it would run the
    # backward's kernels that read a state gradient, builds that eager calls never make (and that the
    # packed builds' warm-up, packed_builds.prepare, does not make either).
    ctx.set_materialize_grads(False)
    *flat, backend = inputs
    n = len(TENSOR_FIELDS)
    a = CoreArgs.from_flat(flat[:n], flat[n:])
    ctx.save_for_backward(*_kept(a, backend), *output[2:])
    ctx.settings, ctx.backend = a.settings(), backend


def _backward(ctx, grads):
    stored = ctx.saved_tensors                 # read once, as in CoreFunction.backward
    n = len(TENSOR_FIELDS)
    kept, saved = stored[:n], list(stored[n:])
    a = _restored(kept, ctx.settings, ctx.backend, saved)
    do, dht = grads[0], grads[1]
    do = torch.zeros_like(a.v) if do is None else do
    out = iter(torch.ops.rewy.delta_rule_backward(*a.tensors(), saved, do, dht, *ctx.settings, ctx.backend))
    present = [None if getattr(a, name) is None else next(out) for name in GRADIENT_FIELDS]
    return (*gradients_by_field(present), *(None,) * (len(ctx.settings) + 1))


_forward_op.register_autograd(_backward, setup_context=_setup_context)
