"""Loading a causal LM for the CLI: a preset, a local directory or a hub id.

Presets are the names in ``presets.PRESETS`` and ``gdn2-<size>`` for every
size in ``models.gdn2.GDN2_PRESETS`` (``gdn2-tiny`` ... ``gdn2-1b``), built
with random weights from a fixed seed.

Hub ids go through the real ``from_pretrained`` path, so they resolve from the
local Hugging Face cache and work offline with ``HF_HUB_OFFLINE=1``. A hub id
that is not in the cache fails at once, before transformers is imported, when
offline mode forbids downloading it or one request without retries finds the
hub unreachable (huggingface_hub would otherwise retry for about a minute).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from .presets import PRESETS, build_preset


class ModelLoadError(RuntimeError):
    """The model could not be built or loaded; the message carries the loader's reason."""


class TokenizerLoadError(ModelLoadError):
    """The model loaded, but the tokenizer it ships did not; the message says what to install or fix."""


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


CACHED_FILES = ("config.json", "adapter_config.json")   # a model repository has one of these


def _is_network_error(exc: BaseException) -> bool:
    """A failure to reach the server at all (DNS, refused connection, timeout), as
    opposed to an answer from it; huggingface_hub's HTTP client raises these."""
    root = type(exc).__module__.split(".")[0]
    return isinstance(exc, (OSError, TimeoutError)) or root in ("httpx", "httpx2", "httpcore", "requests", "urllib3")


def _require_cached_or_reachable(spec: str, revision: str | None) -> None:
    """Raise ModelLoadError at once where ``spec`` (neither a preset nor a directory) is not in
    the local Hugging Face cache and cannot be downloaded: offline mode is on, or the hub
    does not answer one request made without retries. Anything else (a cached model, an
    answer from the hub, an id the hub would reject) is left to ``from_pretrained``."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        if any(isinstance(try_to_load_from_cache(spec, name, revision=revision), str) for name in CACHED_FILES):
            return
    except (HFValidationError, ValueError):
        return          # not a valid repository id: from_pretrained says why
    at = f"@{revision}" if revision else ""
    missing = (f"model {spec + at!r} is not a preset, not a local directory and not in the local Hugging Face "
               f"cache ({constants.HF_HUB_CACHE})")
    # Not preset_names(): naming the GDN2 sizes imports FLA and transformers, seconds this check must not take.
    elsewhere = (f"give a local directory or a preset ({', '.join(PRESETS)}, {GDN2_PREFIX}<size>; "
                 "rewy-hf parity --list-presets lists them all)")
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{missing}, and HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE "
                             f"to download it from the hub, or {elsewhere}")
    try:
        get_hf_file_metadata(hf_hub_url(spec, CACHED_FILES[0], revision=revision),
                             timeout=constants.HF_HUB_ETAG_TIMEOUT, retry_on_errors=False)
    except HfHubHTTPError:
        return          # the hub answered (not found, gated, ...): from_pretrained reports it
    except Exception as exc:
        if not _is_network_error(exc):
            return
        raise ModelLoadError(f"{missing}, and the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached to "
                             f"download it ({type(exc).__name__}: {exc}): check the network connection (or, "
                             f"with the model in the cache, set HF_HUB_OFFLINE=1), or {elsewhere}") from exc


def load_causal_lm(spec: str, *, revision: str | None = None, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", trust_remote_code: bool = False, seed: int = 0) -> LoadedModel:
    if spec in PRESETS:
        model, tokenizer, source = build_preset(spec, seed=seed), None, "preset"
    elif spec.startswith(GDN2_PREFIX) and not os.path.isdir(spec):
        model, tokenizer, source = _build_gdn2(spec[len(GDN2_PREFIX):], seed), None, "preset"
    else:
        source = "local" if os.path.isdir(spec) else "hub"
        if source == "hub":
            _require_cached_or_reachable(spec, revision)

        from transformers import AutoModelForCausalLM, AutoTokenizer

        _register_model_types()
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, revision=revision, dtype=dtype,
                                                         trust_remote_code=trust_remote_code)
        except Exception as exc:  # the loader's own reason is the useful part
            hint = "" if source == "local" else (
                f" (not a preset either: presets are {', '.join(preset_names())})")
            raise ModelLoadError(f"could not load {spec!r}{hint}: {type(exc).__name__}: {exc}") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, revision=revision, trust_remote_code=trust_remote_code)
        except Exception as exc:
            # A model without tokenizer files has no tokenizer; one whose tokenizer fails to load (a
            # missing sentencepiece, custom code, a damaged file) must not be trained on other ids.
            if not _has_tokenizer_files(spec, revision, source):
                tokenizer = None
            else:
                reason = f"{type(exc).__name__}: {str(exc).rstrip('.')}"
                raise TokenizerLoadError(
                    f"{spec!r} has a tokenizer, but it could not be loaded: {reason}. Install "
                    "the package it names (e.g. sentencepiece, tiktoken), pass trust_remote_code "
                    "(--trust-remote-code) if it ships its own code, or repair its tokenizer files") from exc
        else:
            if not _has_tokenizer_files(spec, revision, source):
                # transformers builds a tokenizer from the model's config alone, with a one-token
                # vocabulary: every text would become that token
                tokenizer = None
    return LoadedModel(model.to(device=device, dtype=dtype), tokenizer, source)


# Files one of which every saved Hugging Face tokenizer writes.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _has_tokenizer_files(spec: str, revision: str | None, source: str) -> bool:
    if source == "local":
        return any(os.path.isfile(os.path.join(spec, name)) for name in TOKENIZER_FILES)
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(spec, name, revision=revision), str) for name in TOKENIZER_FILES)
