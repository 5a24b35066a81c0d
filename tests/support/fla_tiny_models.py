"""Tiny FLA-hub models and float64 reference cores for the patch_model tests.

Import this only after ``tests/conftest.py`` has run (pytest does that first):
it switches on the Triton interpreter before FLA is imported, so FLA's short
convolution and fused norms run on CPU. FLA's own chunk ops do not run there,
so every model in this file must have its chunk core replaced, either by
``rewy_hf.patch_model`` or by ``reference_cores()`` below.

* ``build(kind, ...)`` makes one seeded tiny model: ``"delta_net"``,
  ``"gated_deltanet"`` (GVA: 2 key heads, 4 value heads), ``"kda"`` from
  ``fla.models``, or ``"gdn2"``, an embedding + one ``fla.layers.GatedDeltaNet2``
  + a linear head (``fla.models`` has no GDN2 model).
* ``twin(model)`` is an independent copy with the same weights (load_state_dict).
* ``reference_cores()`` temporarily replaces the four FLA core sites by
  ``kernels.reference.naive_*`` (float64, token by token) with FLA's signatures.
* ``torch_short_conv()`` temporarily routes FLA's short convolution to plain
  torch ops (FLA's Triton conv cannot run in float64 under the interpreter).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rewy_hf.patching.reference_cores import replaced_core
from rewy_hf.kernels import reference

VOCAB = 128
HIDDEN = 64

# FLA core site -> (module, attribute, reference function, rewy op name)
SITES = {
    "delta_net": ("fla.layers.delta_net", "chunk_delta_rule", reference.naive_delta_rule, "delta_rule"),
    "gated_deltanet": ("fla.layers.gated_deltanet", "chunk_gated_delta_rule",
                       reference.naive_gated_delta_rule, "gated_delta_rule"),
    "kda": ("fla.layers.kda", "chunk_kda", reference.naive_kda, "kda"),
    "gdn2": ("fla.layers.gdn2", "chunk_gdn2", reference.naive_gdn2, "gdn2"),
}

LAYER_CLASS = {"delta_net": "DeltaNet", "gated_deltanet": "GatedDeltaNet", "kda": "KimiDeltaAttention",
               "gdn2": "GatedDeltaNet2"}

# Keywords FLA's ops take that only pick kernels or memory layouts (no math).
# The reference drops them, but only at the value that changes nothing.
_PLUMBING_DEFAULTS = {"cu_seqlens_cpu": None, "chunk_size": 64, "chunk_indices": None, "disable_recompute": False,
                      "cp_context": None, "return_intermediate_states": False, "use_graph": False,
                      "max_num_seqs": None, "transpose_state_layout": False}
_ALWAYS_DROP = {"cu_seqlens_cpu", "chunk_size", "chunk_indices", "disable_recompute", "max_num_seqs"}


_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, fuse_norm=False, fuse_swiglu=False,
               fuse_cross_entropy=False)


def _config(kind: str, **overrides):
    if kind == "delta_net":
        from fla.models import DeltaNetConfig
        return DeltaNetConfig(**{**_COMMON, "num_heads": 4, **overrides})
    if kind == "gated_deltanet":
        from fla.models import GatedDeltaNetConfig
        return GatedDeltaNetConfig(**{**_COMMON, "num_heads": 2, "head_dim": 16, "num_v_heads": 4,
                                      "expand_v": 1.0, **overrides})
    if kind == "kda":
        from fla.models import KDAConfig
        return KDAConfig(**{**_COMMON, "num_heads": 4, "head_dim": 16, **overrides})
    raise ValueError(kind)


@dataclass
class LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class GDN2LM(nn.Module):
    """Embedding -> one fla.layers.GatedDeltaNet2 (residual) -> linear head, with a causal-LM loss."""

    def __init__(self, num_heads: int = 2, num_v_heads: int = 4, head_dim: int = 16, use_short_conv: bool = True):
        super().__init__()
        from fla.layers import GatedDeltaNet2

        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attn = GatedDeltaNet2(hidden_size=HIDDEN, head_dim=head_dim, num_heads=num_heads,
                                   num_v_heads=num_v_heads, use_short_conv=use_short_conv, layer_idx=0)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        nn.init.normal_(self.embed.weight, std=0.5)

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        h = self.embed(input_ids)
        o, _, _ = self.attn(h, attention_mask=attention_mask)
        logits = self.head(h + o)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return LMOutput(loss, logits)


def build(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> nn.Module:
    """One tiny seeded model in train mode."""
    torch.manual_seed(seed)
    if kind == "gdn2":
        model = GDN2LM(**overrides)
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(_config(kind, **overrides))
    return model.to(dtype).train()


def twin(model: nn.Module, kind: str, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A separately built, unpatched model (other seed) given ``model``'s weights by load_state_dict."""
    other = build(kind, dtype, seed=12345, **overrides)
    other.load_state_dict(model.state_dict())
    return other


def batch(T: int, B: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    return ids, ids.clone()


def reference_core(naive, calls: list):
    """A function with the FLA op's signature that runs ``naive`` in float64.

    The output is cast back to the input dtype and the final state to float32
    (or kept float64 when the inputs are float64). Plumbing keywords are dropped
    (asserting they hold a value that changes no math); any other keyword the
    reference does not know is an error, so nothing is silently ignored.
    """
    accepted = set(inspect.signature(naive).parameters)

    def core(*args, **kwargs):
        for name in list(kwargs):
            if name in accepted:
                continue
            value = kwargs.pop(name)
            if name in _ALWAYS_DROP:
                continue
            if name in _PLUMBING_DEFAULTS and value == _PLUMBING_DEFAULTS[name]:
                continue
            raise TypeError(f"reference core for {naive.__name__}: unexpected keyword {name}={value!r}")
        q = args[0] if args else kwargs["q"]
        calls.append({k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
                     | {"cu_seqlens": kwargs.get("cu_seqlens")})
        o, state = naive(*args, **kwargs)
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return o.to(q.dtype), (None if state is None else state.to(state_dtype))

    core.__name__ = f"reference_{naive.__name__}"
    return core


@contextlib.contextmanager
def reference_site(module_name: str, attr: str, naive, calls: list):
    """Replace one module-level core name by ``reference_core(naive)`` for the block
    (rewy's ``replaced_core``: under a CoreDispatcher its ``original`` is swapped,
    so unpatched models reach the reference and patched ones still reach rewy)."""
    with replaced_core(importlib.import_module(module_name), attr, reference_core(naive, calls)):
        yield calls


@contextlib.contextmanager
def reference_cores():
    """Replace the four FLA chunk-core sites by float64 reference cores for the block.

    Yields a dict kind -> list of recorded calls (their non-tensor keywords and cu_seqlens).
    """
    calls = {kind: [] for kind in SITES}
    with contextlib.ExitStack() as stack:
        for kind, (mod_name, attr, naive, _) in SITES.items():
            stack.enter_context(reference_site(mod_name, attr, naive, calls[kind]))
        yield calls


def torch_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                        activation=None, backend=None, cu_seqlens=None, **kwargs):
    """FLA's ``causal_conv1d`` (depthwise causal conv, then SiLU) as plain torch ops.

    FLA's Triton conv cannot run in float64 under the interpreter (its
    ``tl.cast(..., fp_downcast_rounding='rtne')`` of an fp32 accumulator to
    fp64 is refused) and accumulates in fp32 anyway, so float64 runs use this.
    Only the training path is covered: no cache, no residual.
    """
    if initial_state is not None or output_final_state or residual is not None:
        raise NotImplementedError("torch_causal_conv1d covers the training path only")
    W = weight.shape[-1]

    def conv(xs):
        y = F.conv1d(F.pad(xs.transpose(1, 2), (W - 1, 0)), weight.unsqueeze(1), bias, groups=weight.shape[0])
        return y.transpose(1, 2)

    if cu_seqlens is None:
        y = conv(x)
    else:
        bounds = cu_seqlens.tolist()
        y = torch.cat([conv(x[:, s:e]) for s, e in zip(bounds, bounds[1:])], dim=1)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise NotImplementedError(activation)
    return y, None


@contextlib.contextmanager
def torch_short_conv():
    """Route FLA's short convolutions (``ShortConvolution`` and GatedDeltaNet's
    fused qkv call) to ``torch_causal_conv1d`` for the block."""
    sites = [importlib.import_module(n) for n in ("fla.modules.causal_conv1d.ops", "fla.layers.gated_deltanet")]
    saved = [m.causal_conv1d for m in sites]
    try:
        for m in sites:
            m.causal_conv1d = torch_causal_conv1d
        yield
    finally:
        for m, f in zip(sites, saved):
            m.causal_conv1d = f


def loss_and_grads(model: nn.Module, ids, labels, attention_mask=None):
    """One training step's loss and the gradient of every parameter (by name)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, attention_mask=attention_mask)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient for {missing}"
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are 0)."""
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den else num
