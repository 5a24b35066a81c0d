"""GDN2 (Gated DeltaNet-2) causal LM on FLA's ``GatedDeltaNet2`` layer.

Importing this package registers model type ``"gdn2"`` with ``AutoConfig``,
``AutoModel`` and ``AutoModelForCausalLM``, so saved checkpoints load with
``AutoModelForCausalLM.from_pretrained`` once it has been imported.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_gdn2 import GDN2_PRESETS, GDN2Config, gdn2_config
from .modeling_gdn2 import GDN2Block, GDN2ForCausalLM, GDN2Model, GDN2PreTrainedModel

AutoConfig.register(GDN2Config.model_type, GDN2Config, exist_ok=True)
AutoModel.register(GDN2Config, GDN2Model, exist_ok=True)
AutoModelForCausalLM.register(GDN2Config, GDN2ForCausalLM, exist_ok=True)

__all__ = ["GDN2_PRESETS", "GDN2Block", "GDN2Config", "GDN2ForCausalLM", "GDN2Model", "GDN2PreTrainedModel",
           "gdn2_config"]
