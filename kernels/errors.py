"""Exceptions raised by rewy-hf (the public ops and the kernels beneath them alike).

Every error names the offending argument and what would be accepted instead,
so a user can fix the call without reading our source. They live here, with
the math that raises them, and ``rewy_hf.errors`` exports the same classes.
"""


class UnsupportedConfigError(ValueError):
    """A call asks for something the selected backend cannot compute.

    Subclasses ValueError so code that already guards FLA calls with
    ``except ValueError`` keeps working.
    """


class InputValidationError(ValueError):
    """An input tensor has the wrong shape, rank, dtype or contents."""
