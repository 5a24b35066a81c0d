"""The names rewy-hf gives its ops, backends and save policies, each defined here once.

A delta-rule **family** is the variant of the recurrence: ``delta_rule``
(DeltaNet), ``gdn`` (Gated DeltaNet), ``kda`` (Kimi Delta Attention) or
``gdn2`` (Gated DeltaNet-2). "Family" means that and nothing else. Each family
has three more names, all listed in ``OP_NAMES``:

- its **public op**, the function FLA 0.6.0 and ``rewy_hf.ops`` call it by
  (``chunk_gated_delta_rule``);
- its **report name**, the op an adapter serves, the key of the dispatch
  report and the ``@<op>`` of ``REWY_HF_TEST_FAULT`` (``gated_delta_rule``,
  as FLA's ``fla.ops`` folder names it);
- its **gate kind**: ``none`` (DeltaNet), ``scalar`` (one log-gate per head
  and token) or ``vector`` (one per key channel). The Triton backend runs the
  scalar kind's kernels for ``none`` too (a zero gate).

Backends: ``CORE_BACKENDS`` are the ones the core (core.py) runs;
``BACKENDS`` are the values a caller may pass as ``backend=``: ``auto`` and
every core backend except those ``auto`` alone chooses (``AUTO_ONLY_BACKENDS``:
FlashQLA serves GDN calls only where it is installed and faster, see
flash_qla_route.py). ``POLICIES`` are what the backward keeps from the
forward.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple


class OpNames(NamedTuple):
    """The names of one delta-rule family (module docstring)."""

    family: str
    public: str
    report: str
    gate_kind: str


OP_NAMES = (
    OpNames("delta_rule", "chunk_delta_rule", "delta_rule", "none"),
    OpNames("gdn", "chunk_gated_delta_rule", "gated_delta_rule", "scalar"),
    OpNames("kda", "chunk_kda", "kda", "vector"),
    OpNames("gdn2", "chunk_gdn2", "gdn2", "vector"),
)
GATE_KINDS = ("none", "scalar", "vector")

FAMILIES = tuple(n.family for n in OP_NAMES)
# Read-only: modules that export them under their own names hand out these very objects.
PUBLIC_OPS = MappingProxyType({n.family: n.public for n in OP_NAMES})      # family -> public op
REPORT_OPS = MappingProxyType({n.family: n.report for n in OP_NAMES})      # family -> report name

FLASH_QLA = "flash_qla"
CORE_BACKENDS = ("torch", "triton", FLASH_QLA)
AUTO_ONLY_BACKENDS = (FLASH_QLA,)
BACKENDS = ("auto",) + tuple(b for b in CORE_BACKENDS if b not in AUTO_ONLY_BACKENDS)

POLICIES = ("recompute", "full")


def names_of(family: str) -> OpNames:
    """The names of ``family``; a clear error for anything else."""
    for names in OP_NAMES:
        if names.family == family:
            return names
    raise ValueError(f"unknown delta-rule family {family!r}; expected one of {FAMILIES}")


def family_of_report(report: str) -> str:
    """The family whose report name is ``report`` (``gated_delta_rule`` -> ``gdn``)."""
    for names in OP_NAMES:
        if names.report == report:
            return names.family
    raise ValueError(f"unknown delta-rule op {report!r}; expected one of {tuple(REPORT_OPS.values())}")


def family_of_public(public: str) -> str:
    """The family whose public op is ``public`` (``chunk_gated_delta_rule`` -> ``gdn``)."""
    for names in OP_NAMES:
        if names.public == public:
            return names.family
    raise ValueError(f"unknown delta-rule op {public!r}; expected one of {tuple(PUBLIC_OPS.values())}")


def gate_kind(family: str) -> str:
    """``none``, ``scalar`` or ``vector``: the shape of ``family``'s log-gate."""
    return names_of(family).gate_kind


assert {n.gate_kind for n in OP_NAMES} <= set(GATE_KINDS)
