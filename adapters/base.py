"""What an adapter is: which layer classes it serves and how to call rewy for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from ..kernels.vocabulary import REPORT_OPS, family_of_report


@dataclass(frozen=True)
class Adapter:
    """The delta-rule layers of one source: FLA's layer library, or one transformers model.

    ``source`` is ``"fla"`` for FLA-hub layers, else the transformers model folder
    (``"qwen3_5"``, ...). ``op`` is the op the layers run, by its report name (the dispatch
    report's key: ``"gated_delta_rule"``, ...); ``delta_rule_family`` is the delta-rule family
    behind it (``"gdn"``; kernels/vocabulary.py).

    ``site`` is ``"<module>:<attribute>"``: the module-level core function the
    layer's forward calls for the chunked path. ``decode_site``, where set, is
    the one its one-token decode step calls: it keeps its implementation, except
    that on CPU tensors the plain-torch function behind it runs (transformers 5.24
    picks FLA's recurrent kernel whenever FLA is importable, and that kernel
    needs CUDA; 5.25 falls back to the torch function on CPU itself). ``conv_site``, where set, is the layer's short causal convolution: under
    torch.compile, where it would run transformers' ``F.conv1d`` fallback, rewy runs the same
    convolution as shifted multiply-adds that inductor fuses (kernels/short_conv.py); otherwise
    it keeps its implementation. ``bounds_kwarg`` is the keyword argument of the model's forward
    that carries a packed row's document bounds down to the layer; where the model was given only
    ``position_ids`` that restart at each document, the patched model derives the bounds from them
    and passes them under this name (rewy_hf/patching/packing.py). ``call(args, kwargs, *, backend, policy)`` receives
    the arguments the layer passed to that function and returns ``(o, state)``
    from a rewy op.
    """

    source: str
    op: str
    layer_classes: tuple[str, ...]
    site: str
    call: Callable
    decode_site: str | None = None
    conv_site: str | None = None
    # The keyword under which the model hands a packed row's document bounds down to this layer
    # (FLA's models: ``cu_seqlens``; transformers': the flash-attention ``cu_seq_lens_q``).
    bounds_kwarg: str = "cu_seqlens"

    def __post_init__(self):
        if self.op not in REPORT_OPS.values():
            raise ValueError(f"adapter op {self.op!r} is not a delta-rule op; expected one of "
                             f"{tuple(REPORT_OPS.values())} (kernels/vocabulary.py)")

    @property
    def delta_rule_family(self) -> str:
        """The delta-rule family of ``op`` (``"gdn"`` for ``"gated_delta_rule"``)."""
        return family_of_report(self.op)

    @property
    def sites(self) -> tuple[str, ...]:
        """The chunked-path site, then the decode and convolution sites where there are some."""
        return tuple(s for s in (self.site, self.decode_site, self.conv_site) if s is not None)

    def role(self, site: str) -> str:
        """What the layer calls at ``site``: ``"core"``, ``"decode"`` or ``"conv"``."""
        return {self.site: "core", self.decode_site: "decode", self.conv_site: "conv"}[site]

    @property
    def site_module(self) -> str:
        return split_site(self.site)[0]

    @property
    def site_attr(self) -> str:
        return split_site(self.site)[1]


def split_site(site: str) -> tuple[str, str]:
    """``"<module>:<attribute>"`` -> (module, attribute)."""
    module, attr = site.split(":")
    return module, attr


def qualified_class_names(layer: nn.Module) -> list[str]:
    """The layer's class and its bases as ``module.QualName`` strings."""
    return [f"{c.__module__}.{c.__qualname__}" for c in type(layer).__mro__]


class KeywordCall:
    """Adapter ``call`` for sites whose signature already is FLA's: pass through.
    (A class, not a closure, so patched models can be pickled.)"""

    def __init__(self, op: Callable):
        self.op = op

    def __call__(self, args, kwargs, *, backend, policy):
        return self.op(*args, backend=backend, policy=policy, **kwargs)


keyword_call = KeywordCall
