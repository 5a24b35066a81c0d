"""The environment variables rewy-hf reads: their names, defaults and meaning.

Every reader goes through this module, so `rewy-hf env` and the bench's JSON
can list all of them, and a misspelt value is refused in one place.
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
TEST_FAULT = Setting(
    "REWY_HF_TEST_FAULT", "",
    "grad_scale=<factor>[@<op>]: scale the gradient of that op's output (all ops without @<op>), to prove a "
    "check such as `rewy-hf parity` can fail; for tests only")

SETTINGS = (CHECK_FINITE, TEST_FAULT)


def check_finite_enabled() -> bool:
    text = CHECK_FINITE.value()
    if text not in ("0", "1"):
        raise ValueError(f"{CHECK_FINITE.name}={text!r} is not understood; set it to 1 (check every op's inputs "
                         "for NaN/Inf) or 0 (no check, the default)")
    return text == "1"


def current() -> dict[str, str | None]:
    """Each setting's value as set in the environment (None where unset), for reports."""
    return {s.name: os.environ.get(s.name) for s in SETTINGS}
