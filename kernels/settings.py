"""The environment setting the kernels read: ``REWY_HF_CHECK_FINITE``.

``Setting`` describes one environment variable (its name, default and
meaning). rewy_hf/settings.py lists every setting rewy-hf reads, this one
included, for `rewy-hf env` and the bench's JSON.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    meaning: str

    def value(self) -> str:
        """The current value; unset and empty both read as the default."""
        return os.environ.get(self.name) or self.default


CHECK_FINITE = Setting(
    "REWY_HF_CHECK_FINITE", "0",
    "1: every op checks its inputs for NaN/Inf before it runs (a full pass over them); 0: no check")


def check_finite_enabled() -> bool:
    text = CHECK_FINITE.value()
    if text not in ("0", "1"):
        raise ValueError(f"{CHECK_FINITE.name}={text!r} is not understood; set it to 1 (check every op's inputs "
                         "for NaN/Inf) or 0 (no check, the default)")
    return text == "1"
