"""Exceptions raised by rewy-hf.

Every error names the offending argument and what would be accepted instead,
so a user can fix the call without reading our source.
"""


class UnsupportedConfigError(ValueError):
    """A call asks for something the selected backend cannot compute.

    Subclasses ValueError so code that already guards FLA calls with
    ``except ValueError`` keeps working.
    """


class InputValidationError(ValueError):
    """An input tensor has the wrong shape, rank, dtype or contents."""
