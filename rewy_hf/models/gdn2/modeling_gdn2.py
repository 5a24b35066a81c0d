"""GDN2 (Gated DeltaNet-2) model classes for Hugging Face transformers.

FLA 0.6.0 ships the ``fla.layers.GatedDeltaNet2`` token mixer but no model
around it. This module supplies one with the layout of FLA's
``GatedDeltaNetForCausalLM``, built from FLA's own pieces (imported, not
copied): pre-norm blocks of ``RMSNorm -> mixer -> RMSNorm -> GatedMLP`` with
residuals, FLA's ``FLAModel`` / ``FLAForCausalLM`` forward passes and loss, and
``get_attention`` for the full-attention layers of hybrid configs. Parameter
names match FLA's models (``model.embeddings``, ``model.layers.N.attn``,
``model.layers.N.mlp``, ``model.norm``, ``lm_head``). On the CPU the blocks'
short convolutions, gated norms and SwiGLU run in plain torch
(cpu_modules.py), not in the Triton interpreter.

FLA's block-attention-residual ("attnres") option is not supported.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from fla.layers.gdn2 import GatedDeltaNet2
from fla.models.generation_utils import FLAUnsupportedCacheGenerationMixin
from fla.models.modeling_utils import FLAForCausalLM, FLAModel, FLAPreTrainedModel, get_attention
from fla.modules import GatedMLP, RMSNorm
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_gdn2 import GDN2Config
from .cpu_modules import use_torch_forms_on_cpu

if TYPE_CHECKING:
    from fla.models.cache_utils import Cache


def _norm(config: GDN2Config) -> nn.Module:
    norm_cls = RMSNorm if config.fuse_norm else nn.RMSNorm
    return norm_cls(config.hidden_size, eps=config.norm_eps)


class GDN2Block(GradientCheckpointingLayer):
    """One residual block: token mixer (GDN2, or attention where ``config.attn`` asks) then gated MLP."""

    def __init__(self, config: GDN2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

        self.attn_norm = _norm(config)
        # `get_attention` returns None for layers that keep the native mixer.
        self.attn = get_attention(config=config, layer_idx=layer_idx)
        if self.attn is None:
            self.attn = GatedDeltaNet2(
                hidden_size=config.hidden_size,
                expand_v=config.expand_v,
                head_dim=config.head_dim,
                num_heads=config.num_heads,
                num_v_heads=config.num_v_heads,
                mode=config.attn_mode,
                use_short_conv=config.use_short_conv,
                allow_neg_eigval=config.allow_neg_eigval,
                conv_size=config.conv_size,
                conv_bias=config.conv_bias,
                layer_idx=layer_idx,
                norm_eps=config.norm_eps,
            )
        self.mlp_norm = _norm(config)
        self.mlp = GatedMLP(
            hidden_size=config.hidden_size,
            hidden_ratio=config.hidden_ratio,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            fuse_swiglu=config.fuse_swiglu,
        )
        use_torch_forms_on_cpu(self)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        attnres_states: list[torch.Tensor] | None = None,
        **kwargs,
    ):
        residual = hidden_states
        mixed, attentions, past_key_values = self.attn(
            hidden_states=self.attn_norm(hidden_states),
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            output_attentions=output_attentions,
            **kwargs,
        )
        if self.config.fuse_norm:
            # FLA's fused RMSNorm adds the residual and returns (normed, new residual).
            normed, residual = self.mlp_norm(x=mixed, residual=residual, prenorm=True)
        else:
            residual = residual + mixed
            normed = self.mlp_norm(residual)
        hidden_states = residual + self.mlp(normed, **kwargs)
        # FLAModel.forward unpacks four values; the last (attnres state) is unused here.
        return hidden_states, attentions, past_key_values, attnres_states


class GDN2PreTrainedModel(FLAPreTrainedModel):
    config_class = GDN2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GDN2Block"]
    _supports_cache_class = True

    def _init_weights(self, module: nn.Module, prenorm_residual_strategy: str | None = None,
                      num_residuals_per_layer: int = 2):
        if isinstance(module, GatedDeltaNet2):
            self._init_gdn2_gates(module)
        super()._init_weights(module, prenorm_residual_strategy, num_residuals_per_layer)

    @staticmethod
    def _init_gdn2_gates(module: GatedDeltaNet2) -> None:
        """Re-draw the decay parameters the way GatedDeltaNet2.__init__ does, unless loaded from a checkpoint.

        A_log ~ log U(1, 16) per head; dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1].
        """
        if module.A_log.device.type == "meta":
            return
        with torch.no_grad():
            if not getattr(module.A_log, "_is_hf_initialized", False):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1, 16).log())
            if not getattr(module.dt_bias, "_is_hf_initialized", False):
                log_dt = torch.rand_like(module.dt_bias) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)
                dt = log_dt.exp().clamp(min=1e-4)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        module.A_log._no_weight_decay = True
        module.dt_bias._no_weight_decay = True


class GDN2Model(GDN2PreTrainedModel, FLAModel):
    """Embeddings, ``config.num_hidden_layers`` GDN2Blocks and a final norm (forward: ``FLAModel``)."""

    def __init__(self, config: GDN2Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=self.padding_idx)
        self.layers = nn.ModuleList([GDN2Block(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        self.norm = _norm(config)
        self.use_attnres = False   # read by FLAModel.forward
        self.gradient_checkpointing = False
        self.post_init()


class GDN2ForCausalLM(GDN2PreTrainedModel, FLAForCausalLM, FLAUnsupportedCacheGenerationMixin):
    """GDN2Model plus a linear LM head; loss and logits come from ``FLAForCausalLM``."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: GDN2Config):
        super().__init__(config)
        self.model = GDN2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.criterion = None
        self.post_init()
