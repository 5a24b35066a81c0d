"""The kernels a compiled unpatched model runs where rewy compares against one (the
end-to-end bench's unpatched compiled side, ``rewy-hf parity --compile``).

transformers' kernel-or-fallback wrapper (``use_kernel_func_from_hub_with_fallback``,
around each model's delta-rule core) runs its plain-torch function instead of the
installed package's op (FLA) whenever ``torch.compiler.is_exporting()`` says True.
On torch 2.11 dynamo traces that call as True inside every ``torch.compile``, so there
a compiled unpatched model traces transformers' reference core -- a Python loop over
chunks, unrolled once per layer -- and a ~1 B hybrid did not finish compiling in nine
minutes on an H200. The baseline the compiled comparison means is the installed
kernels with their graph breaks, which is what newer torch (2.13) traces, so while
the unpatched compiled side runs the wrapper's export check reads False. A patched
model needs none of this: its layers call rewy's op, never the wrapper.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


def _not_exporting() -> bool:
    return False


@contextlib.contextmanager
def installed_kernels_under_compile() -> Iterator[bool]:
    """Within the block transformers' kernel wrappers keep the installed kernel package's op
    when traced by dynamo; yields whether there was an export check to hold (False on a
    transformers without one, which then needs nothing)."""
    from transformers.integrations import hub_kernels

    saved = getattr(hub_kernels, "is_torchdynamo_exporting", None)
    if saved is None:
        yield False
        return
    hub_kernels.is_torchdynamo_exporting = _not_exporting
    try:
        yield True
    finally:
        hub_kernels.is_torchdynamo_exporting = saved
