"""The model and tokenizer a recipe run trains: a GDN2 preset, another rewy preset, a local
directory or a hub id; and the Linear layers LoRA wraps.
"""

from __future__ import annotations

import os
import sys

import torch

from .data import ByteTokenizer
from .options import LORA_TARGETS, RecipeError


def _gdn2_preset_name(spec: str) -> str | None:
    from rewy_hf.models.gdn2 import GDN2_PRESETS   # imports fla: the CPU interpreter is already on

    name = spec[len("gdn2-"):] if spec.startswith("gdn2-") else spec
    if name in GDN2_PRESETS:
        return name
    if spec.startswith("gdn2-"):
        raise RecipeError(f"unknown GDN2 preset {spec!r}; use one of "
                          f"{', '.join('gdn2-' + n for n in GDN2_PRESETS)}")
    return None


def _all_presets() -> str:
    from rewy_hf.models.gdn2 import GDN2_PRESETS
    from rewy_hf.models.presets import PRESETS

    return ", ".join([f"gdn2-{n}" for n in GDN2_PRESETS] + list(PRESETS))


def load_model_and_tokenizer(args):
    """(model, tokenizer, source). Random-init presets get the byte tokenizer; a loaded model keeps its own
    tokenizer (or a byte tokenizer saved by this recipe), else the byte tokenizer. The embedding table is
    grown if the tokenizer has more ids than the model's vocabulary."""
    from rewy_hf.models.loading import ModelLoadError, TokenizerLoadError, load_causal_lm
    from rewy_hf.models.presets import PRESETS, build_preset

    spec = args.model
    gdn2_name = _gdn2_preset_name(spec)
    if gdn2_name is not None:
        from rewy_hf.models.gdn2 import GDN2ForCausalLM, gdn2_config

        tok = ByteTokenizer()
        cfg = gdn2_config(gdn2_name)
        cfg = gdn2_config(gdn2_name, vocab_size=max(cfg.vocab_size, tok.vocab_size), bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            model = GDN2ForCausalLM(cfg)
        return model, tok, "preset"
    if spec in PRESETS:
        return _fit_vocab(build_preset(spec, seed=args.seed), ByteTokenizer()), ByteTokenizer(), "preset"
    is_dir = os.path.isdir(spec)
    if not is_dir and (os.path.exists(spec) or spec.startswith((".", "/", "~"))):
        raise RecipeError(f"--model {spec!r} is not a model directory (no such directory); pass a directory with "
                          "config.json, a hub id (org/name) or a preset")
    if not is_dir and "/" not in spec:
        raise RecipeError(f"unknown preset {spec!r}; presets: {_all_presets()} (or pass a local model directory "
                          "or a hub id like org/name)")
    try:
        loaded = load_causal_lm(spec, revision=args.revision, trust_remote_code=args.trust_remote_code)
    except TokenizerLoadError as exc:
        raise RecipeError(str(exc)) from None
    except ModelLoadError as exc:
        raise RecipeError(f"{exc}. Check the path / hub id (offline? set HF_HUB_OFFLINE=1 and pre-download), or "
                          f"use a preset: {_all_presets()}") from None
    tok = loaded.tokenizer
    if is_dir and ByteTokenizer.saved_in(spec):
        tok = ByteTokenizer()
    elif tok is None:
        # said aloud: byte ids replace the model's own special-token ids in its config
        print(f"note: {spec} has no tokenizer files; training on byte ids (ByteTokenizer: bytes 0-255, bos/eos/pad "
              "256-258), which also become the saved model's special-token ids", file=sys.stderr)
        tok = ByteTokenizer()
    return _fit_vocab(loaded.model, tok), tok, loaded.source


def _fit_vocab(model, tok):
    needed = len(tok)
    if model.get_input_embeddings().num_embeddings < needed:
        model.resize_token_embeddings(needed)
    if isinstance(tok, ByteTokenizer):
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(model.config, k, getattr(tok, k))
    return model


def lora_targets(model, requested: str | None) -> list[str]:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if requested:
        wanted = [t.strip() for t in requested.split(",") if t.strip()]
        missing = [t for t in wanted if t not in names]
        if missing:
            raise RecipeError(f"--lora-targets {missing} are not Linear layers of this model; it has "
                              f"{', '.join(sorted(names))}")
        return wanted
    found = [t for t in LORA_TARGETS if t in names]
    if not found:
        raise RecipeError(f"no default LoRA target in this model; pass --lora-targets from: {', '.join(sorted(names))}")
    return found
