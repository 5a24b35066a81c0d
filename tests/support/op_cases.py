"""Random inputs for the four ops, shared by the float64 gradient tests.

``make_case`` returns (args, kwargs, leaves): positional and keyword arguments
for both our op and the float64 reference, and the tensors whose gradients
are compared. Gates are log-sigmoids of a normal draw unless a regime asks
otherwise: "strong_decay" puts every log-gate in [-8, -4] so cumulative gates
over a chunk reach -500 (exp(-G) would overflow even float64 if formed
naively), "long_memory" puts them near -1e-3, and "tiny_beta" draws betas
around 1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

OPS = ("delta_rule", "gdn", "kda", "gdn2")


def _gates(shape, regime: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if regime == "strong_decay":
        return -4.0 - 4.0 * torch.rand(*shape, generator=gen, dtype=torch.float64)
    if regime == "long_memory":
        return -1e-3 * torch.rand(*shape, generator=gen, dtype=torch.float64)
    return F.logsigmoid(x)


def _betas(shape, regime: str, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(*shape, generator=gen, dtype=torch.float64)
    return 1e-6 * u if regime == "tiny_beta" else u


def make_case(op: str, gen: torch.Generator, *, T=150, B=2, H=2, HV=None, K=16, V=8, h0=False,
              cu=None, l2=False, gate_in_kernel=False, beta_sigmoid=False, neg_eig=False,
              v_first=False, regime="normal", lower_bound=None):
    HV = HV or H
    if cu is not None:
        B = 1
        T = int(cu[-1])
    N = B if cu is None else len(cu) - 1
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = r(B, T, H, K), r(B, T, H, K)
    if not l2:
        k = F.normalize(k, dim=-1)
    v = r(B, T, HV, V)
    kwargs = dict(output_final_state=True)
    if l2:
        kwargs["use_qk_l2norm_in_kernel"] = True
    if cu is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.long)
    if h0:
        shape = (N, HV, V, K) if v_first else (N, HV, K, V)
        kwargs["initial_state"] = 0.5 * r(*shape)
    if v_first:
        kwargs["state_v_first"] = True

    if op == "delta_rule":
        args = [q, k, v, _betas((B, T, HV), regime, gen)]
    elif op == "gdn":
        g = r(B, T, HV) if gate_in_kernel else _gates((B, T, HV), regime, gen)
        beta = r(B, T, HV) if beta_sigmoid else _betas((B, T, HV), regime, gen)
        args = [q, k, v, g, beta]
        if gate_in_kernel:
            kwargs.update(use_gate_in_kernel=True, A_log=0.3 * r(HV), dt_bias=r(HV))
    else:
        gh = HV if op == "kda" else H
        g = r(B, T, gh, K) if gate_in_kernel else _gates((B, T, gh, K), regime, gen)
        if op == "kda":
            beta = r(B, T, HV) if beta_sigmoid else _betas((B, T, HV), regime, gen)
            args = [q, k, v, g, beta]
        else:
            args = [q, k, v, g, _betas((B, T, H, K), regime, gen), torch.rand(B, T, H, V, generator=gen,
                                                                           dtype=torch.float64)]
        if gate_in_kernel:
            kwargs.update(use_gate_in_kernel=True, A_log=0.3 * r(gh), dt_bias=r(gh * K))
            if lower_bound is not None:
                kwargs.update(lower_bound=lower_bound, safe_gate=True)
    if beta_sigmoid:
        kwargs["use_beta_sigmoid_in_kernel"] = True
    if neg_eig:
        kwargs["allow_neg_eigval"] = True
    leaves = [t.requires_grad_() for t in args]
    for key in ("initial_state", "A_log", "dt_bias"):
        if key in kwargs:
            leaves.append(kwargs[key].requires_grad_())
    return args, kwargs, leaves
