"""Swapping the delta-rule core of a model's layers, per instance.

``patch`` binds the wrapper into each supported layer and installs the
dispatcher at its core site, ``dispatch`` routes calls and counts what ran,
``report`` says what was patched, ``auto_patch`` (``rewy_hf.enable``)
patches every model created from now on through ``model_creation``'s
post_init hook, ``reference_cores`` gives an unpatched model a core that runs
where its original cannot, ``flash_qla`` detects the one peer
faster than rewy, ``context_parallel`` runs a patched model's layers
context-parallel (``build_cp_context`` builds FLA's context after checking
its arguments), and ``fault`` is the deliberate fault tests use to prove the
checks can fail.
"""

from .context_parallel import build_cp_context, context_parallel
from .dispatch import dispatch_report, reset_dispatch_report
from .auto_patch import disable, enable
from .patch import is_patched, patch_model, patched, unpatch_model
from .report import PatchReport

__all__ = ["PatchReport", "build_cp_context", "context_parallel", "disable", "dispatch_report", "enable", "is_patched",
           "patch_model", "patched", "reset_dispatch_report", "unpatch_model"]
