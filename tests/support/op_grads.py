"""Outputs and input gradients of one delta-rule op call, for the GPU tests of GDN and DeltaNet."""

from __future__ import annotations

import torch


def outputs_and_grads(fn, args, kw, do, dht) -> list[torch.Tensor]:
    """[o, final state, the gradients of ``args`` and of kw's initial state if it has one] for
    the loss sum(o * do) + sum(final state * dht), on fresh leaves of every float tensor."""
    leaves = [a.detach().requires_grad_() for a in args]
    kw = {k: (v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k, v in kw.items()}
    o, ht = fn(*leaves, **kw)
    extra = [kw["initial_state"]] if "initial_state" in kw else []
    return [o, ht] + list(torch.autograd.grad((o.float() * do).sum() + (ht.float() * dht).sum(), leaves + extra))
