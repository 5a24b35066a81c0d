"""The compiled unpatched side keeps the installed kernel where dynamo reads is_exporting() as True."""

import sys
import types

import pytest
import torch

from transformers.integrations import hub_kernels

from rewy_hf.installed_kernels import installed_kernels_under_compile


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


@pytest.mark.gpu
def test_compiled_unpatched_qwen3_5_runs_fla_only_inside_the_hold():
    """On the GPU, the unpatched tiny Qwen3.5's delta-rule call is FLA's op (a graph break under
    compile) inside the hold. Outside it, it is FLA's op exactly where this torch traces
    is_exporting() as False; where it traces True (torch 2.11) transformers runs its reference
    there and dynamo sees no break. The forward matches the eager one either way."""
    from torch._dynamo.utils import counters

    import hf_tiny_models as hf

    model = hf.one_layer_qwen3_5().cuda()
    x = torch.randint(0, model.config.vocab_size, (2, 128), device="cuda")
    with torch.no_grad():
        eager = model(input_ids=x).logits
        reads_exporting = bool(torch.compile(lambda t: t + torch.compiler.is_exporting(), backend="eager")(
            torch.zeros(1, device="cuda")).item())

        def compiled_breaks():
            torch._dynamo.reset()
            counters.clear()
            out = torch.compile(model, backend="eager")(input_ids=x).logits
            return sum(counters["graph_break"].values()), out

        with installed_kernels_under_compile() as was_held:
            held_breaks, held = compiled_breaks()
        plain_breaks, plain = compiled_breaks()
    torch._dynamo.reset()
    assert was_held and held_breaks >= 1
    assert (plain_breaks == 0) is reads_exporting, (plain_breaks, reads_exporting)
    for out in (held, plain):
        assert (out.float() - eager.float()).abs().max() <= 1e-2 * eager.float().abs().max()
