"""The short causal convolution of a delta-rule layer, written so torch.compile fuses it.

transformers' layers mix q, k and v over the last few tokens with a depthwise
causal ``nn.Conv1d`` (width 4) and an activation; without the ``causal-conv1d``
package they run it as ``F.conv1d``. Inductor hands every convolution to an
external library kernel, so a compiled layer still spends a full cuDNN depthwise
convolution forward and three backward kernels on it. Written as one
multiply-add per tap on shifted views, in float32 with the activation applied
before the single rounding, the same sum becomes elementwise and reduction
work that inductor fuses with what surrounds it (the measured effect is in
docs/performance.md, "End-to-end: torch.compile").

Packed rows (several documents in one row, with their bounds in ``cu_seqlens``)
take the same sum with each tap masked where it would reach into the previous
document, so the convolution restarts at every document start as it does for
a document run alone. The mask is built on the device from the bounds, with
shapes that depend on T and W only, so a compiled graph does not change with
the number or lengths of the documents. Eagerly, where nothing fuses those
taps (a dozen float32 passes over the row per layer, forward and backward),
the row goes through ``F.conv1d`` as transformers' own path runs it, and only
the first W - 1 outputs of each document, the ones that read across a bound,
are recomputed from their own document.

Eagerly on CUDA, packed or not, the convolution runs on FLA's causal convolution
kernels instead (``triton_short_conv``), with the activation fused: its Gluon kernels where they
serve the call, else its Triton kernels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def causal_short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None) -> torch.Tensor:
    """``out[b, c, t] = act(bias[c] + sum_j weight[c, j] * x[b, c, t - W + 1 + j])`` with x zero
    before t = 0; x ``[B, C, T]``, weight ``[C, W]``; the result in x's dtype.

    The value of transformers' ``causal_conv1d_fn`` torch path (``F.conv1d`` with
    ``padding=W - 1``, cut to T), except that the activation sees the float32 sum rather than its
    rounding to the weight's dtype. Summed in float32 (float64 for float64 weights)."""
    check_conv_inputs(x, weight)
    return conv_taps(F.pad(x, (weight.shape[-1] - 1, 0)), weight, bias, activation)


def packed_causal_short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             activation: str | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``causal_short_conv`` over one packed row x [1, C, T] whose documents ``cu_seqlens`` bounds
    (``[0, ..., T]``): every output reads only inputs of its own document. Traced, the masked-tap
    sum (shapes from T and W only); eagerly, ``F.conv1d`` and the outputs after each bound redone."""
    check_conv_inputs(x, weight)
    check_one_row(x)
    if not torch.compiler.is_compiling():
        return _restarted_conv1d(x, weight, bias, activation, cu_seqlens)
    W, T = weight.shape[-1], x.shape[-1]
    keep = sequence_keep(cu_seqlens, T, W, x.device)
    return conv_taps(F.pad(x, (W - 1, 0)), weight, bias, activation, keep)


def triton_short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                      cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
    """The convolution on FLA's causal convolution kernels (forward and backward, the activation
    fused, the sum in float32 and one rounding), for x [B, C, T] as transformers passes it, packed
    rows restarting at every bound of ``cu_seqlens``; and which kernels ran it. For eager CUDA calls,
    where transformers would otherwise run ``F.conv1d`` and the activation as separate library kernels.

    ``"fla-gluon"``: FLA's Gluon kernels, wherever they serve the call (an NVIDIA GPU, a Triton with
    Gluon, and what FLA's own check for them accepts: one process, width 2-4, one packed row). FLA
    leaves them off unless ``FLA_CONV_GLUON`` is set; rewy calls them directly. ``"fla-triton"``:
    FLA's Triton kernels, everywhere else."""
    check_conv_inputs(x, weight)
    if cu_seqlens is not None:
        check_one_row(x)
    # FLA's layout is [B, T, C]: transformers hands a transposed view of one, so no copy either way.
    xt = x.transpose(1, 2).contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32)
    gluon = fla_gluon_conv() if x.is_cuda else None
    if gluon is not None and gluon.causal_conv1d_fwd_verifier(x=xt, weight=weight, cu_seqlens=cu)[0]:
        return _GluonShortConv.apply(xt, weight, bias, activation, cu).transpose(1, 2), "fla-gluon"
    from fla.modules.convolution import causal_conv1d

    out, _ = causal_conv1d(xt, weight, bias, activation=activation, backend="triton", cu_seqlens=cu)
    return out.transpose(1, 2), "fla-triton"


@functools.cache
def fla_gluon_conv():
    """FLA's Gluon convolution module, or None where this machine cannot run it."""
    from fla.backends import GluonBackend

    if not GluonBackend.is_available():
        return None
    try:
        from fla.modules.causal_conv1d.backends import gluon
    except ImportError:         # a Triton whose Gluon lacks what FLA's kernels use
        return None
    return gluon


class _GluonShortConv(torch.autograd.Function):
    """FLA's Gluon forward and backward as one autograd node, on x [B, T, C] with contiguous channels.
    Saves x, not the pre-activation: the backward recomputes it, as FLA's own function does."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, cu_seqlens):
        from fla.ops.utils import prepare_chunk_indices

        weight = weight.contiguous()        # the backward kernels index it densely
        # the packed row's 64-token chunk table, built once for the forward and the backward
        chunks = None if cu_seqlens is None else prepare_chunk_indices(cu_seqlens, 64)
        y, _ = fla_gluon_conv().causal_conv1d_fwd_gluon(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                                        chunk_indices=chunks)
        ctx.save_for_backward(x, weight, bias, cu_seqlens, chunks)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens, chunks = ctx.saved_tensors
        dx, dw, db, _, _ = fla_gluon_conv().causal_conv1d_bwd_gluon(
            x, dy, None, weight=weight, bias=bias, activation=ctx.activation, cu_seqlens=cu_seqlens,
            chunk_indices=chunks)
        return dx, dw, db, None, None


def _restarted_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                      cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The row through ``F.conv1d``, as transformers' torch path runs it, then the first W - 1
    outputs of every document after the first recomputed from their own document's inputs: only
    those outputs read across a bound. A few columns per document, gathered by indices read on
    the host, so this form is for eager calls."""
    W, T, C = weight.shape[-1], x.shape[-1], x.shape[1]
    x_ext = F.pad(x, (W - 1, 0))
    y = F.conv1d(x_ext, weight[:, None, :].to(x.dtype), None if bias is None else bias.to(x.dtype), groups=C)
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    t = (cu[1:-1, None] + torch.arange(W - 1, device=x.device)).reshape(-1)
    t = torch.unique(t[t < T])
    if t.numel():
        start = cu[torch.searchsorted(cu, t, right=True) - 1]
        source = t[:, None] - (W - 1) + torch.arange(W, device=x.device)       # [M, W] input positions
        acc = torch.promote_types(weight.dtype, torch.float32)
        taps = x_ext[0][:, source + (W - 1)].to(acc) * (source >= start[:, None])
        fixed = (taps * weight.to(acc)[:, None, :]).sum(-1)
        if bias is not None:
            fixed = fixed + bias.to(acc)[:, None]
        y = y.index_copy(2, t, fixed.to(y.dtype)[None])
    if activation is not None:
        from transformers.activations import ACT2FN

        y = ACT2FN[activation](y)
    return y


def sequence_keep(cu_seqlens: torch.Tensor, T: int, W: int, device,
                  borrowed: torch.Tensor | None = None) -> torch.Tensor:
    """[W, T] bool: whether tap j of output t reads an input of t's own document. ``borrowed``: how
    many inputs before position 0 belong to the first document (context parallelism: the previous
    rank's tail); none by default. Built on the device, no host read."""
    t = torch.arange(T, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    # the last bound at or before t; over the whole tensor, since inductor (torch 2.11) cannot lower
    # searchsorted over a slice
    start = cu[torch.searchsorted(cu, t, right=True) - 1]
    if borrowed is not None:
        start = torch.where(start == 0, -borrowed.to(device), start)
    source = t[None, :] - (W - 1) + torch.arange(W, device=device)[:, None]
    return source >= start[None, :]


def conv_taps(x_ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              activation: str | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The convolution over ``x_ext`` [B, C, W - 1 + T]: the W - 1 inputs before the first output
    position, then the T inputs; the result [B, C, T] in x_ext's dtype. ``keep`` [W, T] (bool):
    whether tap j reaches an input of output t's own sequence (packed sequences); None keeps all."""
    W = weight.shape[-1]
    T = x_ext.shape[-1] - (W - 1)
    acc = torch.promote_types(weight.dtype, torch.float32)      # float32, or float64 for float64 weights
    xf = x_ext.to(weight.dtype).to(acc)
    wf = weight.to(acc)

    def tap(j):
        term = xf[..., j:j + T] * wf[:, j, None]
        return term if keep is None else term * keep[j]

    out = tap(0)
    for j in range(1, W):
        out = out + tap(j)
    if bias is not None:
        out = out + bias.to(acc)[:, None]
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(x_ext.dtype)


def check_one_row(x: torch.Tensor) -> None:
    if x.shape[0] != 1:
        raise ValueError(f"a packed convolution takes one row (B = 1) with its document bounds in cu_seqlens, "
                         f"got B = {x.shape[0]}; flatten the documents into one row, as "
                         "DataCollatorWithFlattening does.")


def check_conv_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_short_conv takes x [B, C, T] and weight [C, W]; got x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}")
