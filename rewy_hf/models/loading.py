"""Loading a causal LM for the CLI: a preset, a local directory or a hub id.

Presets are the names in ``presets.PRESETS`` and ``gdn2-<size>`` for every
size in ``models.gdn2.GDN2_PRESETS`` (``gdn2-tiny`` ... ``gdn2-1b``), built
with random weights from a fixed seed.

Hub ids go through the real ``from_pretrained`` path, so they resolve from the
local Hugging Face cache and work offline with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from .presets import PRESETS, build_preset


class ModelLoadError(RuntimeError):
    """The model could not be built or loaded; the message carries the loader's reason."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object | None
    source: str          # "preset", "local", or "hub"


def _register_model_types() -> None:
    """Make FLA's and rewy's model types known to the Auto classes."""
    import fla.models  # noqa: F401  (registers FLA configs with AutoConfig)

    from . import gdn2  # noqa: F401


GDN2_PREFIX = "gdn2-"


def preset_names() -> list[str]:
    from .gdn2 import GDN2_PRESETS

    return list(PRESETS) + [GDN2_PREFIX + n for n in GDN2_PRESETS]


def _build_gdn2(name: str, seed: int) -> nn.Module:
    from .gdn2 import GDN2_PRESETS, GDN2ForCausalLM, gdn2_config

    if name not in GDN2_PRESETS:
        raise ModelLoadError(f"unknown GDN2 preset {GDN2_PREFIX + name!r}; GDN2 presets are "
                             f"{', '.join(GDN2_PREFIX + n for n in GDN2_PRESETS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GDN2ForCausalLM(gdn2_config(name))


def load_causal_lm(spec: str, *, revision: str | None = None, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", trust_remote_code: bool = False, seed: int = 0) -> LoadedModel:
    if spec in PRESETS:
        model, tokenizer, source = build_preset(spec, seed=seed), None, "preset"
    elif spec.startswith(GDN2_PREFIX) and not os.path.isdir(spec):
        model, tokenizer, source = _build_gdn2(spec[len(GDN2_PREFIX):], seed), None, "preset"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _register_model_types()
        source = "local" if os.path.isdir(spec) else "hub"
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, revision=revision, dtype=dtype,
                                                         trust_remote_code=trust_remote_code)
        except Exception as exc:  # the loader's own reason is the useful part
            hint = "" if source == "local" else (
                f" (not a preset either: presets are {', '.join(preset_names())})")
            raise ModelLoadError(f"could not load {spec!r}{hint}: {type(exc).__name__}: {exc}") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, revision=revision, trust_remote_code=trust_remote_code)
        except Exception:
            tokenizer = None
    return LoadedModel(model.to(device=device, dtype=dtype), tokenizer, source)
