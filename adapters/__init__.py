"""Adapters that swap the delta-rule core of FLA's layers and of transformers' models (see base.Adapter).

The registry is a flat tuple; ``find_adapter`` matches a layer by its class
(or a base class) qualified name, so matching a layer imports no modeling
module.
"""

from __future__ import annotations

import re

import torch.nn as nn

from .base import Adapter, qualified_class_names


def all_adapters() -> tuple[Adapter, ...]:
    from . import fla_hub, transformers_gdn, transformers_kda

    return fla_hub.ADAPTERS + transformers_gdn.ADAPTERS + transformers_kda.ADAPTERS


def find_adapter(layer: nn.Module) -> Adapter | None:
    names = qualified_class_names(layer)
    for adapter in all_adapters():
        if any(name in adapter.layer_classes for name in names):
            return adapter
    return None


# Class names that look like a delta-rule token mixer; a module that matches
# but has no adapter is reported as "found, not patched" so users see the gap.
_DELTA_RULE_NAME = re.compile(r"(Delta(Net|Attention|Rule|Product)|GatedDelta|KimiDelta|\bKDA)", re.IGNORECASE)


def looks_like_delta_rule(layer: nn.Module) -> bool:
    cls = type(layer)
    if not _DELTA_RULE_NAME.search(cls.__name__):
        return False
    # Containers (decoder layers, whole models) are not the mixer itself.
    return not re.search(r"(DecoderLayer|Block|Model|ForCausalLM|Config|Cache)$", cls.__name__)
