"""Tiny random transformers models of the 9 families rewy-hf patches, for CPU tests.

Every builder is seeded, so two calls give identical weights. The configs
follow the survey of transformers 5.24 (small enough to run forward and
backward on CPU in a fraction of a second), with two delta-rule layers per
model so per-layer counting is meaningful.

On a CPU box with FLA installed, transformers' own chunk core (the hub
wrapper) calls FLA's Triton op and crashes; ``reference_core(family)`` makes
the modeling module's chunk global the plain-torch function for the duration
of a block. It composes with rewy's ``CoreDispatcher``: when one is installed,
only its ``original`` is swapped, so patched instances still reach rewy while
unpatched ones run the plain-torch core.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from rewy_hf.adapters.transformers_common import torch_reference
from rewy_hf.patching.reference_cores import replaced_core

SEED = 0
VOCAB = 128

_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)
_GDN = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16)
_KDA = dict(linear_head_dim=16, linear_num_heads=4)


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _layers(attn: str = "full_attention") -> dict:
    return dict(num_hidden_layers=3, layer_types=["linear_attention", attn, "linear_attention"])


@dataclass(frozen=True)
class Family:
    name: str                 # the transformers model folder (models/<name>/)
    config_class: str
    model_class: str
    config_kwargs: dict
    layer_class: str          # the delta-rule token mixer
    op: str                   # rewy op name in the dispatch report
    site_attr: str            # module global the layer's chunked path calls
    causal_lm: bool = True    # False: a base model, the loss is built from the hidden states
    lora_targets: tuple[str, ...] = field(default=())

    @property
    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")

    @property
    def configuration(self):
        return importlib.import_module(f"transformers.models.{self.name}.configuration_{self.name}")


_GDN_SITE = "torch_chunk_gated_delta_rule"
_KDA_SITE = "chunk_kimi_delta_attention"

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(**_SMALL, **_GDN, **_layers()),
           "Qwen3_5GatedDeltaNet", "gated_delta_rule", _GDN_SITE, lora_targets=("in_proj_qkv", "out_proj")),
    Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
           dict(**_without(_SMALL, "intermediate_size"), **_GDN, **_MOE, **_layers()),
           "Qwen3_5MoeGatedDeltaNet", "gated_delta_rule", _GDN_SITE, lora_targets=("in_proj_qkv", "out_proj")),
    Family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(**_SMALL, **_GDN, **_MOE, **_layers()),
           "Qwen3NextGatedDeltaNet", "gated_delta_rule", _GDN_SITE, lora_targets=("in_proj_qkvz", "out_proj")),
    Family("olmo_hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM",
           dict(**_without(_SMALL, "head_dim"), **_GDN, **_layers(), pad_token_id=0, eos_token_id=1),
           "OlmoHybridGatedDeltaNet", "gated_delta_rule", _GDN_SITE, lora_targets=("q_proj", "k_proj", "v_proj")),
    Family("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM",
           dict(**_without(_SMALL, "intermediate_size"), **_GDN, **_MOE, **_layers("indexed_attention"),
                hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                indexer_compress_ratio=4),
           "Qwen4ExpTextGatedDeltaNet", "gated_delta_rule", _GDN_SITE, lora_targets=("in_proj_qkv", "out_proj")),
    Family("lara_mini", "LaraMiniConfig", "LaraMiniForCausalLM", dict(**_SMALL, **_GDN, **_MOE, **_layers()),
           "LaraMiniGatedDeltaNet", "gated_delta_rule", _GDN_SITE, lora_targets=("in_proj_qkv", "out_proj")),
    Family("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM",
           dict(**_without(_SMALL, "head_dim", "num_key_value_heads"), num_key_value_heads=4, **_MLA,
                moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **_layers(), **_KDA,
                pad_token_id=0, bos_token_id=1, eos_token_id=2),
           "KimiLinearDeltaAttention", "kda", _KDA_SITE, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    Family("bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM",
           dict(**_without(_SMALL, "num_key_value_heads"), num_key_value_heads=4, **_MLA, moe_intermediate_size=32,
                num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                **_layers(), **_KDA, num_mtp_layers=0, pad_token_id=0, eos_token_id=1),
           "BailingHybridDeltaAttention", "kda", _KDA_SITE, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    Family("glm5_next", "Glm5NextTextConfig", "Glm5NextTextModel",
           dict(**_without(_SMALL, "head_dim", "num_key_value_heads"), num_key_value_heads=4, kv_lora_rank=16,
                q_lora_rank=16, qk_rope_head_dim=0, v_head_dim=16, qk_nope_head_dim=16, moe_intermediate_size=32,
                n_routed_experts=4, num_experts_per_tok=2, **_layers("indexed_attention"), **_KDA, index_topk=16,
                index_kpool=4, index_head_dim=16, index_n_heads=2, pad_token_id=0),
           "Glm5NextTextLinearAttention", "kda", _KDA_SITE, causal_lm=False,
           lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
)}

GDN_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.op == "gated_delta_rule")
KDA_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.op == "kda")


def family_of(name_or_family) -> Family:
    return name_or_family if isinstance(name_or_family, Family) else FAMILIES[name_or_family]


def make_config(family, route_all_experts: bool = False):
    """``route_all_experts``: every token goes to every expert. Top-k routing is a step function of
    the router's scores, so two bf16 runs that round differently (one process against context
    parallelism) can send a token to different experts and differ by far more than rounding;
    with every expert taken the model stays a smooth function of its inputs."""
    fam = family_of(family)
    # "eager" experts: the default grouped_mm path has no float64 kernel.
    cfg = getattr(fam.configuration, fam.config_class)(**fam.config_kwargs, experts_implementation="eager")
    if route_all_experts and getattr(cfg, "num_experts_per_tok", None):
        cfg.num_experts_per_tok = next(getattr(cfg, n) for n in ("num_local_experts", "num_experts",
                                                                  "n_routed_experts") if getattr(cfg, n, None))
    return cfg


def _init_gates(model, family, seed: int) -> None:
    """Moderate decays in every delta-rule layer: A_log ~ log U(0.5, 1), dt_bias ~ U(-6, -2).

    With transformers' default init (A up to 16) most heads forget within a
    token or two: the state hardly crosses a chunk boundary and the gate
    gradients vanish (~1e-9), so neither would be tested. These values give
    per-token decays exp(g) of about 0.3-0.999 for both the softplus gate
    (GDN, Kimi) and the lower-bound sigmoid gate (Bailing, GLM-5-Next).
    """
    gen = torch.Generator().manual_seed(seed + 7)
    cls = family_of(family).layer_class
    with torch.no_grad():
        for layer in model.modules():
            if type(layer).__name__ != cls:
                continue
            for name, p in layer.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf == "A_log":
                    p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(0.5, 1.0, generator=gen).log())
                elif leaf == "dt_bias":
                    p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(-6.0, -2.0, generator=gen))


def build(family, *, seed: int = SEED, dtype: torch.dtype = torch.float32, train: bool = True,
          route_all_experts: bool = False):
    """A tiny random model of ``family`` (same weights for the same seed)."""
    fam = family_of(family)
    cls = getattr(fam.modeling, fam.model_class)
    torch.manual_seed(seed)
    model = cls(make_config(fam, route_all_experts))
    _init_gates(model, fam, seed)
    return model.to(dtype).train(train)


def one_layer_qwen3_5():
    """The tiny Qwen3.5 with its one delta-rule layer only and no cache, in training mode: less to
    compile than ``build``'s three layers, for the tests that compile it."""
    fam = FAMILIES["qwen3_5"]
    cfg = make_config(fam)
    cfg.num_hidden_layers, cfg.layer_types, cfg.use_cache = 1, ["linear_attention"], False
    torch.manual_seed(SEED)
    model = getattr(fam.modeling, fam.model_class)(cfg)
    _init_gates(model, fam, SEED)
    return model.train()


def delta_rule_only(family, layers: int = 2, route_all_experts: bool = False):
    """The tiny ``family`` model with every layer a delta-rule layer and no cache, in training mode
    (the configuration context parallelism serves: no attention layer)."""
    fam = family_of(family)
    cfg = make_config(fam, route_all_experts)
    cfg.num_hidden_layers, cfg.layer_types, cfg.use_cache = layers, ["linear_attention"] * layers, False
    torch.manual_seed(SEED)
    model = getattr(fam.modeling, fam.model_class)(cfg)
    _init_gates(model, fam, SEED)
    return model.train()


def twin(model):
    """A second instance of the same class and config with identical weights."""
    torch.manual_seed(SEED + 1)
    other = type(model)(model.config).to(next(model.parameters()).dtype)
    other.load_state_dict(model.state_dict())
    return other.train(model.training)


def delta_rule_layer_names(model, family) -> list[str]:
    """Names of the family's delta-rule layers, found by walking the model."""
    cls = family_of(family).layer_class
    return [name for name, m in model.named_modules() if type(m).__name__ == cls]


def input_ids(batch: int = 2, seq_len: int = 77, *, seed: int = 1234) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq_len), generator=gen)


def loss_of(model, ids: torch.Tensor, family=None) -> torch.Tensor:
    """The training loss, in the model's dtype: next-token cross-entropy of the
    logits (transformers' own loss would upcast float64 logits to float32 only),
    or for a base model a fixed random readout of the last hidden state (so
    every position matters)."""
    out = model(input_ids=ids)
    if _is_causal_lm(model, family):
        logits = out.logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    h = out.last_hidden_state
    gen = torch.Generator().manual_seed(99)
    w = torch.randn(h.shape[-1], generator=gen, dtype=torch.float64).to(h.dtype)
    return torch.tanh(h @ w).square().mean()


def _is_causal_lm(model, family) -> bool:
    if family is not None:
        return family_of(family).causal_lm
    return type(model).__name__.endswith("ForCausalLM") or hasattr(model, "lm_head")


@contextlib.contextmanager
def core_replaced(family, core: Callable):
    """Make ``core`` the function an unpatched layer of ``family`` calls, for a block
    (rewy's ``replaced_core``: dispatcher-aware, restores on exit)."""
    fam = family_of(family)
    with replaced_core(fam.modeling, fam.site_attr, core) as fn:
        yield fn


@contextlib.contextmanager
def reference_core(family):
    """transformers' own plain-torch chunk core (FLA's Triton path skipped) for a block."""
    fam = family_of(family)
    with core_replaced(fam, torch_reference(fam.modeling, fam.site_attr)) as fn:
        yield fn


def float64_core(op: str) -> Callable:
    """A core with transformers' call convention computing rewy's float64 ground truth."""
    from rewy_hf.kernels.reference import naive_gated_delta_rule, naive_kda

    naive = {"gated_delta_rule": naive_gated_delta_rule, "kda": naive_kda}[op]

    def core(query, key, value, g=None, beta=None, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, **ignored):
        return naive(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    core.__name__ = f"float64_{op}_core"
    return core


@contextlib.contextmanager
def float64_reference_core(family):
    fam = family_of(family)
    with core_replaced(fam, float64_core(fam.op)) as fn:
        yield fn
