"""A patched model run context-parallel: ``with context_parallel(model, cp_context): model(...)``.

FLA 0.6.0 has context parallelism in its ops (``cp_context``) and in its short
convolution, but its layers do not pass a context to either. Inside this block
every patched delta-rule layer of ``model`` does: its core call reaches rewy's
op with ``cp_context`` (kernels/context_parallel.py), and its short
convolution exchanges the inputs it needs across ranks, so each rank's first
``W - 1`` convolution inputs come from the previous rank: FLA's layers through
FLA's own exchange (their ``causal_conv1d`` gets the context), transformers'
layers through rewy's (their ``causal_conv1d_fn`` call becomes
kernels/context_parallel_conv.py). The attention layers of transformers'
hybrids (Qwen3.5, Qwen3-Next, Kimi-Linear, OLMo-hybrid) attend over the whole
row through an all-gather of their keys and values
(context_parallel_attention.py); they need the row's global ``cu_seqlens`` and
the caller's ``position_ids``. Everything else in these models is per token,
so a rank that feeds its slice of the packed row computes its slice of the
whole row's outputs.

Refused, with the reason: FLA's attention layers (hybrid FLA configs),
delta-rule layers that are not patched, a context without a process group,
contexts and row bounds that do not describe one packed row
(context_parallel_checks.py), a hybrid called without ``position_ids``, and
inputs longer or shorter than the rank's slice.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.nn as nn

from ..errors import UnsupportedConfigError
from .context_parallel_attention import RowAttention, attention_layers, require_positions, row_attention_active
from .context_parallel_checks import check_row, row_fault
from ..kernels.context_parallel_call import check_slice, cp_call
from .dispatch import active_context, set_active_context
from .patch import patch_state

# FLA's module-level short-convolution names its layers call: ShortConvolution's, and the fused
# q/k/v convolution of GatedDeltaNet.
_CONV_SITES = ("fla.modules.causal_conv1d.ops", "fla.layers.gated_deltanet")


def _refusal(model: nn.Module, attention: list[nn.Module], cu_seqlens) -> str | None:
    states = [s for s in map(patch_state, model.modules()) if s is not None]
    if not states:
        return "the model has no patched delta-rule layer; call rewy_hf.patch_model(model) first"
    # FLA's blocks hold their token mixer as ``attn``, transformers' decoder layers as ``self_attn``
    # (Qwen3.5's delta-rule layers are ``linear_attn``, Kimi-Linear's are ``self_attn``).
    served = {id(m) for m in attention}
    mixers = [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("attn", "self_attn")
              and patch_state(m) is None and id(m) not in served]
    if mixers:
        return (f"the token mixer {mixers[0]} ({type(model.get_submodule(mixers[0])).__name__}) is neither a patched "
                "delta-rule layer nor a transformers full_attention layer (dense causal attention), and other "
                "attention (FLA's attention layers, sliding-window or indexed attention) has no context parallelism "
                "here: use a config whose token mixers are delta-rule or full_attention layers (FLA: attn=None)")
    if attention and cu_seqlens is None:
        return (f"the model has attention layers ({type(attention[0]).__name__}); pass cu_seqlens=<the whole row's "
                "sequence bounds> (and position_ids to the model) so that they attend over the row")
    return None


_WRAPPED: dict = {}


def _with_context(original):
    """FLA's convolution ``original`` with the active context, as FLA's layers would pass it if they
    took one. One wrapper per function, kept: compiled code checks that the name still holds it."""
    if (wrapper := _WRAPPED.get(original)) is not None:
        return wrapper

    def conv(*args, **kwargs):
        call = active_context()
        # Under torch.compile the same sum is rewy's, whose exchange is a custom op: FLA's sends and
        # receives run inside an autograd Function, which dynamo does not trace. On the CPU too:
        # FLA's exchange does not run in Triton's interpreter.
        x = args[0] if args else kwargs.get("x")
        on_cpu = isinstance(x, torch.Tensor) and x.device.type == "cpu"
        if ((torch.compiler.is_compiling() or on_cpu) and not args and call.group_name
                and kwargs.get("residual") is None and kwargs.get("initial_state") is None
                and not kwargs.get("output_final_state")):
            from ..kernels.context_parallel_conv import cp_causal_short_conv

            y = cp_causal_short_conv(x.transpose(1, 2), kwargs["weight"], kwargs.get("bias"),
                                     kwargs.get("activation"), call)
            return y.transpose(1, 2).contiguous(), None
        if isinstance(x, torch.Tensor) and x.dim() == 3 and not torch.compiler.is_compiling():
            check_slice(call.bounds, x.shape[1])
        return original(*args, **{**kwargs, "cp_context": call.fla_context})

    _WRAPPED[original] = conv
    return conv


@contextlib.contextmanager
def context_parallel(model: nn.Module, cp_context, cu_seqlens=None):
    """Run ``model``'s patched delta-rule layers and their short convolutions with ``cp_context``
    (FLA's, from ``fla.ops.cp.build_cp_context``) inside the block.

    ``cu_seqlens``: the whole packed row's sequence bounds (the ones ``cp_context`` was built from);
    needed when the model has transformers attention layers, which then attend over the row, and
    checked against ``cp_context`` whenever given. Pass the model each local token's place in its
    sequence as ``position_ids`` (``RowAttention.positions``) and ``attention_mask={layer type:
    None}``: the bounds say the mask.

    Entering the block is collective: every rank of the context's group enters it together, and
    all refuse if any rank's context or bounds do not describe one packed row."""
    attention = attention_layers(model)
    if (reason := _refusal(model, attention, cu_seqlens)) is not None:
        raise UnsupportedConfigError(f"context_parallel: {reason}.")
    sites = [importlib.import_module(name) for name in _CONV_SITES]
    saved = [site.causal_conv1d for site in sites]

    # The layers take the context as a CPCall: its per-row values in tensors, so a compiled model
    # neither breaks its graph at the exchanges nor compiles again for a new packing. Its own checks
    # are left to check_row, which refuses on every rank at once.
    call = cp_call("context_parallel", cp_context, keep_fla_context=True, checked=False)
    check_row(call, cp_context.group, cu_seqlens)
    row = RowAttention(cu_seqlens, cp_context.group) if attention else None
    if attention:
        require_positions(model)
    # These sizes follow the packing: dynamic from the first compile, so a new packing reuses the graph
    # (dynamo still gives a rank holding one sequence a graph of its own: it specialises a size of 1).
    for t in (call.cu_seqlens, call.bounds) + ((row.bounds,) if row is not None else ()):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    rows = row_attention_active(attention, row, model) if attention else contextlib.nullcontext()
    previous = set_active_context(call)
    try:
        for site, original in zip(sites, saved):
            site.causal_conv1d = _with_context(original)
        with rows:
            yield cp_context
    finally:
        for site, original in zip(sites, saved):
            site.causal_conv1d = original
        set_active_context(previous)


def build_cp_context(cu_seqlens: torch.Tensor, group=None, conv1d_kernel_size: int | None = None,
                     cu_seqlens_cpu: torch.Tensor | None = None):
    """FLA's ``fla.ops.cp.build_cp_context`` (contiguous layout) for this rank of ``group``, after
    checking what FLA takes on trust or refuses with a bare assertion: a process group, and the
    whole row's ``cu_seqlens`` from 0 upwards, never decreasing, its length a multiple of the
    group's size. The same on every rank of the group (not collective)."""
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context as fla_build_cp_context

    if group is None:
        start = ("" if dist.is_available() and dist.is_initialized() else
                 "call torch.distributed.init_process_group() in every process first (torchrun sets up the "
                 "ranks), then ")
        raise UnsupportedConfigError(
            "build_cp_context: group=None; a context-parallel context needs the process group whose ranks share "
            f"the row: {start}pass group=torch.distributed.group.WORLD (every rank) or the subgroup that splits "
            "the row. To run the whole row in one process, pass cu_seqlens to the model or op instead of a "
            "context.")
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()
            or cu_seqlens.dtype == torch.bool):
        raise UnsupportedConfigError("build_cp_context: cu_seqlens must be a 1-D integer tensor of the whole row's "
                                     "sequence bounds [0, ..., row length].")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    if (fault := row_fault(host.tolist(), dist.get_world_size(group))) is not None:
        raise UnsupportedConfigError(f"build_cp_context: {fault}.")
    return fla_build_cp_context(cu_seqlens, group=group, conv1d_kernel_size=conv1d_kernel_size,
                                cu_seqlens_cpu=cu_seqlens_cpu)
