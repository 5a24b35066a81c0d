"""Exceptions raised by rewy-hf: ``UnsupportedConfigError`` and ``InputValidationError``.

Both are defined in ``rewy_hf.kernels.errors`` (the kernels raise them too, and
depend on nothing above them); these are the same classes, so
``except rewy_hf.errors.UnsupportedConfigError`` catches what the kernels raise.
"""

from .kernels.errors import InputValidationError, UnsupportedConfigError

__all__ = ["InputValidationError", "UnsupportedConfigError"]
