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


def check_runs_here(args, device: torch.device) -> None:
    """RecipeError, before the data and the model are loaded, where ``--model`` names a GDN2 preset that
    cannot run on ``device``: a hybrid's full-attention layers are FLA's ``Attention``, which its
    constructor refuses without flash-attn, a CUDA-only package."""
    import importlib.util

    name = _gdn2_preset_name(args.model)
    if name is None:
        return
    from rewy_hf.models.gdn2 import GDN2_PRESETS

    attn = GDN2_PRESETS[name].get("attn")
    if not attn:
        return
    installed = importlib.util.find_spec("flash_attn") is not None
    if installed and device.type == "cuda":
        return
    missing = "flash-attn is not installed" if not installed else "flash-attn runs on CUDA GPUs only"
    fix = ("install it on a CUDA machine (pip install flash-attn --no-build-isolation) and run there"
           if not installed else "run on a CUDA GPU")
    raise RecipeError(f"--model {args.model}: its full-attention layers ({', '.join(map(str, attn['layers']))}) "
                      f"are FLA's Attention, which needs flash-attn, and {missing}; "
                      f"{fix}, or train a model without them: gdn2-1b (the same size, delta-rule layers only) or "
                      "qwen3.5-1b (a hybrid whose attention runs in torch, on CPU too)")


#: From this many parameters up, a CPU run gets a warning of its time per step and its checkpoints' size.
CPU_LARGE_PARAMS = 250_000_000


def cpu_size_warning(model, args, device: torch.device) -> str | None:
    """The warning for a model too large to train comfortably on CPU (None on a GPU or for a smaller model):
    its time per step and the disk its checkpoints take, from its parameters and the run's settings."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if device.type != "cpu" or total < CPU_LARGE_PARAMS:
        return None
    weights = sum(p.numel() * p.element_size() for p in params)
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    # checkpoint-N: the model as save_pretrained writes it (the adapter alone under LoRA), the full state
    # accelerate saves for --resume, and AdamW's two moments of every trained parameter.
    per_checkpoint = (trained if args.lora else weights) + weights + 2 * trained
    saves = {args.max_steps} | (set(range(args.save_every, args.max_steps + 1, args.save_every))
                                if args.save_every else set())
    kept = min(len(saves), args.keep_checkpoints) if args.keep_checkpoints else len(saves)
    disk = kept * per_checkpoint + weights      # + final/
    return (f"warning: {total:,} parameters on CPU: expect many seconds per step (8-34 s for the ~1 B "
            f"presets), and about {_size(per_checkpoint)} per checkpoint, {_size(disk)} in all "
            f"({kept} checkpoint(s) kept with --save-every {args.save_every}, --max-steps {args.max_steps} and "
            f"--keep-checkpoints {args.keep_checkpoints}, plus final/); train on a GPU, or smoke-test on CPU with "
            "gdn2-tiny or tiny-qwen3.5")


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


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
