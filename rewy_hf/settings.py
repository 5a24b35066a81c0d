"""The environment variables rewy-hf reads: their names, defaults and meaning.

Every setting is listed here (``SETTINGS``), so `rewy-hf env` and the bench's
JSON can list all of them, and a misspelt value is refused in one place. The
one the kernels read, ``CHECK_FINITE``, is defined beside them
(rewy_hf/kernels/settings.py, which the kernels may import) and listed here
as the same object.
"""

from __future__ import annotations

import os

from .kernels.settings import CHECK_FINITE, Setting, check_finite_enabled

__all__ = ["CHECK_FINITE", "SETTINGS", "Setting", "TEST_FAULT", "check_finite_enabled", "current"]

TEST_FAULT = Setting(
    "REWY_HF_TEST_FAULT", "",
    "grad_scale=<factor>[@<op>]: scale the gradient of that op's output (all ops without @<op>), to prove a "
    "check such as `rewy-hf parity` can fail; for tests only")

SETTINGS = (CHECK_FINITE, TEST_FAULT)


def current() -> dict[str, str | None]:
    """Each setting's value as set in the environment (None where unset), for reports."""
    return {s.name: os.environ.get(s.name) for s in SETTINGS}
