"""Random models built from config with a fixed seed, for commands that must
work anywhere with no download (``--model tiny-qwen3.5`` ...): tiny ones for
CPU checks, and ``qwen3.5-1b`` for `rewy-hf bench --model` on a GPU (its GDN2
counterpart is ``gdn2-1b``, from ``models.gdn2.GDN2_PRESETS``), with
``qwen3.5-gva-1b`` and ``kimi-linear-1b`` for `rewy-hf bench --model --compile`."""

from __future__ import annotations

import importlib
import warnings
from typing import Callable

import torch
import torch.nn as nn

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16)
_GDN = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
# ~1B Qwen3.5-like hybrid for model-level benchmarks: the width, depth and FFN of
# the GDN2 1b preset (2048 / 20 / 4096, 16 x 128 delta-rule heads) with
# Qwen3.5's 3:1 linear/full attention layout (5 full-attention layers), and
# GDN2's 32000-token vocabulary rather than Qwen3.5's 248320, so that the two
# presets' step times differ by their mixers, not by a 1B-parameter embedding.
# 1,023,802,208 parameters.
_QWEN35_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096, num_hidden_layers=20,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16)
# The two ~1B hybrids of the end-to-end (torch.compile) benchmark, 16 layers each with a 3:1
# delta-rule / attention layout. Qwen3.5-like: GVA (16 key, 32 value heads of 128), 4 gated
# full-attention layers. Kimi-Linear-like: 16 KDA heads of 128, 4 MLA layers, a dense MLP
# everywhere (no MoE), so the step is the mixers and the MLP, as in the Qwen3.5-like one.
_HYBRID_16 = ["linear_attention"] * 3 + ["full_attention"]
_QWEN35_GVA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                      layer_types=_HYBRID_16 * 4, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                      linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                      linear_num_value_heads=32)
_KIMI_LINEAR_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                       layer_types=_HYBRID_16 * 4, mlp_layer_types=["dense"] * 16, num_attention_heads=16,
                       num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                       v_head_dim=128, qk_nope_head_dim=128, moe_intermediate_size=1024, num_local_experts=8,
                       num_experts_per_tok=2, linear_head_dim=128, linear_num_heads=16, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
# The same two with the published vocabularies (Qwen3.5: 248,320 tokens; Kimi-Linear: 163,840), for
# the packed fine-tuning benchmark (bench/packed_bench.py), where the logits and the loss weigh as
# they do in a real run.
_QWEN35_GVA_1B_248K = {**_QWEN35_GVA_1B, "vocab_size": 248320}
_KIMI_LINEAR_1B_164K = {**_KIMI_LINEAR_1B, "vocab_size": 163840}
_FLA = dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, fuse_norm=False, fuse_swiglu=False,
            fuse_cross_entropy=False, use_short_conv=False)


def _hf(model: str, config_cls: str, model_cls: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        cfg_mod = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
        mdl_mod = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        return getattr(mdl_mod, model_cls)(getattr(cfg_mod, config_cls)(**kwargs))
    return build


def _fla(config_cls: str, model_cls: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        import fla.models as fm
        return getattr(fm, model_cls)(getattr(fm, config_cls)(**_FLA, **kwargs))
    return build


def _gdn2(**kwargs) -> Callable[[], nn.Module]:
    def build():
        from .gdn2 import GDN2Config, GDN2ForCausalLM
        return GDN2ForCausalLM(GDN2Config(**_FLA, **kwargs))
    return build


PRESETS: dict[str, Callable[[], nn.Module]] = {
    "tiny-qwen3.5": _hf("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **_SMALL, **_GDN),
    "tiny-qwen3.5-moe": _hf("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                            **{k: v for k, v in _SMALL.items() if k != "intermediate_size"}, **_GDN, **_MOE),
    "tiny-qwen3-next": _hf("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", **_SMALL, **_GDN, **_MOE),
    "tiny-olmo-hybrid": _hf("olmo_hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM",
                            **{k: v for k, v in _SMALL.items() if k != "head_dim"}, **_GDN, pad_token_id=0,
                            eos_token_id=1),
    "tiny-kimi-linear": _hf("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM",
                            **{k: v for k, v in _SMALL.items() if k not in ("head_dim", "num_key_value_heads")},
                            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                            v_head_dim=16, qk_nope_head_dim=16, moe_intermediate_size=32, num_local_experts=4,
                            num_experts_per_tok=2, num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"], linear_head_dim=16,
                            linear_num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "tiny-fla-deltanet": _fla("DeltaNetConfig", "DeltaNetForCausalLM", num_heads=4),
    "tiny-fla-gdn": _fla("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM", num_heads=2, head_dim=16,
                         num_v_heads=4, expand_v=1.0),
    "tiny-fla-kda": _fla("KDAConfig", "KDAForCausalLM", num_heads=4, head_dim=16),
    "tiny-fla-gdn2": _gdn2(num_heads=4, head_dim=16),
    "qwen3.5-1b": _hf("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **_QWEN35_1B),
    "qwen3.5-gva-1b": _hf("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **_QWEN35_GVA_1B),
    "kimi-linear-1b": _hf("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", **_KIMI_LINEAR_1B),
    "qwen3.5-gva-1b-248k": _hf("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **_QWEN35_GVA_1B_248K),
    "kimi-linear-1b-164k": _hf("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", **_KIMI_LINEAR_1B_164K),
}


def build_preset(name: str, seed: int = 0) -> nn.Module:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # The FLA presets leave out the short convolution on purpose (under the
        # CPU interpreter it is most of a step's time); FLA warns about that.
        warnings.filterwarnings("ignore", message="ShortConvolution is crucial")
        torch.manual_seed(seed)
        return PRESETS[name]()
