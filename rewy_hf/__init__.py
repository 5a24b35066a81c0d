"""rewy-hf: faster training of delta-rule attention models, same gradients.

The ReWY backward (Residual WY, Matrix Intra, Gram Elimination) behind FLA's
op signatures. See README.md and docs/architecture.md.
"""

from .errors import InputValidationError, UnsupportedConfigError
from .ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_gdn2, chunk_kda
from .patching import (PatchReport, build_cp_context, context_parallel, disable, dispatch_report, enable, is_patched,
                       patch_model, patched, reset_dispatch_report, unpatch_model)

__version__ = "0.1.0"

__all__ = [
    "InputValidationError",
    "UnsupportedConfigError",
    "build_cp_context",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gdn2",
    "chunk_kda",
    "context_parallel",
    "disable",
    "dispatch_report",
    "enable",
    "is_patched",
    "patch_model",
    "PatchReport",
    "patched",
    "reset_dispatch_report",
    "unpatch_model",
    "__version__",
]
