"""Configuration for the GDN2 (Gated DeltaNet-2) causal LM, plus size presets.

The fields follow ``fla.models.GatedDeltaNetConfig`` so that FLA's shared
model code (``FLAModel``, ``FLAForCausalLM``, ``get_attention``) reads them the
same way. ``attn`` turns selected layers into standard (flash) attention for
hybrid layouts, e.g. ``{"layers": [3, 7], "num_heads": 16}``; it is validated
by FLA's ``AttentionConfigBase`` exactly as in FLA's own configs.

Presets (``gdn2_config(name, **overrides)``); parameter counts are exact for
the listed settings and checked in ``tests/models/test_gdn2_model.py`` (built on the
meta device, no memory used):

========== ====== ====== ============ ====== ======= ============ ==============
name       hidden layers heads x dim  ffn    vocab   tied emb     parameters
========== ====== ====== ============ ====== ======= ============ ==============
tiny       64     2      4 x 16       256    256     no           190,568
small      384    6      6 x 64       1024   32000   yes          25,301,796
350m       1024   21     8 x 128      2816   32000   yes          357,912,360
1b         2048   20     16 x 128     4096   32000   no           1,159,336,768
1b-hybrid  2048   20     16 x 128     4096   32000   no           1,112,006,768
========== ====== ====== ============ ====== ======= ============ ==============

``1b-hybrid`` is ``1b`` with every 4th layer (indices 3, 7, 11, 15, 19) a
full-attention layer (16 heads, 16 KV heads, RoPE); those layers need
``flash_attn`` installed, as in every FLA hybrid model. ``tiny`` turns FLA's
fused norm / SwiGLU / cross-entropy kernels off so it runs in seconds on CPU.
"""

from __future__ import annotations

import copy
from typing import Any

from fla.models.configuration_utils import AttentionConfig, AttentionConfigBase, validate_loss_config
from transformers.configuration_utils import PreTrainedConfig


class GDN2Config(AttentionConfigBase, PreTrainedConfig):
    """Hyper-parameters of ``GDN2Model`` / ``GDN2ForCausalLM``.

    Mixer fields (``num_heads``, ``head_dim``, ``num_v_heads``, ``expand_v``,
    ``use_short_conv``, ``conv_size``, ``conv_bias``, ``allow_neg_eigval``,
    ``attn_mode``) go to ``fla.layers.GatedDeltaNet2`` unchanged. The MLP is
    FLA's ``GatedMLP`` (``hidden_ratio`` / ``intermediate_size`` /
    ``hidden_act``). ``num_hidden_layers`` must be set before ``attn``, which
    FLA's base class validates against it.
    """

    model_type = "gdn2"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        attn_mode: str = "chunk",
        hidden_size: int = 2048,
        expand_v: float = 1.0,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        max_position_embeddings: int = 2048,
        hidden_ratio: int | None = 4,
        intermediate_size: int | None = None,
        hidden_act: str = "swish",
        num_hidden_layers: int = 24,
        norm_eps: float = 1e-6,
        attn: AttentionConfig = None,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fuse_norm: bool = True,
        fuse_swiglu: bool = True,
        fuse_cross_entropy: bool = True,
        fuse_linear_cross_entropy: bool = False,
        use_l2warp: bool = False,
        vocab_size: int = 32000,
        **kwargs,
    ):
        if attn_mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"attn_mode must be 'chunk' or 'fused_recurrent', got {attn_mode!r}.")
        self.attn_mode = attn_mode
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.allow_neg_eigval = allow_neg_eigval
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.max_position_embeddings = max_position_embeddings
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.num_hidden_layers = num_hidden_layers   # before `attn`: its validation reads it
        self.norm_eps = norm_eps
        self.attn = attn
        self.use_cache = use_cache
        self.initializer_range = initializer_range
        self.fuse_norm = fuse_norm
        self.fuse_swiglu = fuse_swiglu
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        self.use_l2warp = use_l2warp
        self.vocab_size = vocab_size

        validate_loss_config(fuse_cross_entropy=fuse_cross_entropy, fuse_linear_cross_entropy=fuse_linear_cross_entropy)

        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


_CPU_FRIENDLY = dict(fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False)

_1B = dict(hidden_size=2048, num_hidden_layers=20, num_heads=16, head_dim=128, intermediate_size=4096,
           vocab_size=32000, tie_word_embeddings=False)

#: Preset name -> GDN2Config keyword arguments (see the module docstring for sizes).
GDN2_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=16, intermediate_size=256,
                 vocab_size=256, tie_word_embeddings=False, **_CPU_FRIENDLY),
    "small": dict(hidden_size=384, num_hidden_layers=6, num_heads=6, head_dim=64, intermediate_size=1024,
                  vocab_size=32000, tie_word_embeddings=True),
    "350m": dict(hidden_size=1024, num_hidden_layers=21, num_heads=8, head_dim=128, intermediate_size=2816,
                 vocab_size=32000, tie_word_embeddings=True),
    "1b": dict(_1B),
    "1b-hybrid": dict(_1B, attn={"layers": list(range(3, _1B["num_hidden_layers"], 4)), "num_heads": 16,
                                 "num_kv_heads": 16, "window_size": None}),
}


def gdn2_config(name: str, **overrides: Any) -> GDN2Config:
    """A fresh ``GDN2Config`` for preset ``name`` (one of ``GDN2_PRESETS``), with ``overrides`` applied."""
    try:
        kwargs = copy.deepcopy(GDN2_PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown GDN2 preset {name!r}; choose one of {sorted(GDN2_PRESETS)}") from None
    kwargs.update(overrides)
    return GDN2Config(**kwargs)
