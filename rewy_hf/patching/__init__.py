"""Swapping the delta-rule core of a model's layers, per instance.

``patch`` binds the wrapper into each supported layer and installs the
dispatcher at its core site, ``dispatch`` routes calls and counts what ran,
``report`` says what was patched, ``reference_cores`` gives an unpatched model
a core that runs where its original cannot, ``flash_qla`` detects the one peer
faster than rewy, ``context_parallel`` runs a patched model's layers
context-parallel, and ``fault`` is the deliberate fault tests use to prove the
checks can fail.
"""

from .context_parallel import context_parallel
from .dispatch import dispatch_report, reset_dispatch_report
from .patch import is_patched, patch_model, patched, unpatch_model
from .report import PatchReport

__all__ = ["PatchReport", "context_parallel", "dispatch_report", "is_patched", "patch_model", "patched", "reset_dispatch_report",
           "unpatch_model"]
