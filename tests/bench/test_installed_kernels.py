"""The compiled unpatched side keeps the installed kernel where dynamo reads is_exporting() as True."""

import sys
import types

import pytest
import torch

from transformers.integrations import hub_kernels

from rewy_hf.bench.installed_kernels import installed_kernels_under_compile


@pytest.fixture
def wrapped_core(monkeypatch):
    """A transformers kernel-or-fallback wrapper over a stand-in kernel package, and the calls it made."""
    calls = []
    package = types.ModuleType("rewy_test_kernel_package")

    def core(x):
        calls.append("kernel")
        return x * 2

    package.core = core
    monkeypatch.setitem(sys.modules, package.__name__, package)

    @hub_kernels.use_kernel_func_from_hub_with_fallback("core", package.__name__)
    def reference(x):
        calls.append("reference")
        return x * 2

    return reference, calls


@pytest.mark.parametrize("reads_exporting", [True, False])
def test_compiled_wrapper_runs_the_installed_kernel_inside_the_block(wrapped_core, monkeypatch, reads_exporting):
    """With the export check reading True under compile (torch 2.11's tracing of is_exporting),
    the wrapper falls back to its reference; inside the block it keeps the kernel, and the check
    is restored after."""
    reference, calls = wrapped_core
    monkeypatch.setattr(hub_kernels, "is_torchdynamo_exporting", lambda: reads_exporting)
    x = torch.arange(4.0)

    torch._dynamo.reset()
    torch.compile(reference, backend="eager")(x)
    assert calls == ["reference" if reads_exporting else "kernel"]

    calls.clear()
    torch._dynamo.reset()
    with installed_kernels_under_compile() as held:
        out = torch.compile(reference, backend="eager")(x)
    assert held and calls == ["kernel"] and torch.equal(out, x * 2)
    assert hub_kernels.is_torchdynamo_exporting() is reads_exporting
