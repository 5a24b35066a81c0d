"""On/off switches read from the environment at each call (REWY_HF_DIRECT_LAUNCH, REWY_HF_FUSED_PRESTAGE,
REWY_HF_GDN_DX_FROM_DY).

Each takes ``1`` or ``0`` (empty means the default); any other value is an
error that names both settings, so a typo never silently picks one.
"""

from __future__ import annotations

import os


def flag(name: str, default: bool, on: str, off: str) -> bool:
    """The switch ``name``: True for 1, False for 0, ``default`` when unset or empty.
    ``on`` / ``off`` say what each setting does, for the error message."""
    mode = os.environ.get(name, "").strip()
    if mode == "":
        return default
    if mode in ("0", "1"):
        return mode == "1"
    first, second = (("1", on), ("0", off)) if default else (("0", off), ("1", on))
    raise ValueError(f"{name}={mode!r} is not understood; use {first[0]} ({first[1]}, the default) "
                     f"or {second[0]} ({second[1]})")
