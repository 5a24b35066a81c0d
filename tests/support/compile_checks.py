"""One check shared by the compile tests of the cores: a function compiles to one graph and its
compiled gradients are the eager ones."""

from __future__ import annotations

import torch

from rewy_hf.rel_error import rel_err


def assert_one_graph_with_eager_grads(f, leaves, tol: float = 1e-6) -> None:
    """``f(*leaves)`` (a scalar) compiled with fullgraph=True under aot_eager is one frame, and the
    gradients of its compiled run match the eager ones to ``tol`` relative."""
    from torch._dynamo.testing import CompileCounterWithBackend

    eager = torch.autograd.grad(f(*leaves), leaves)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.autograd.grad(torch.compile(f, backend=counter, fullgraph=True)(*leaves), leaves)
    assert counter.frame_count == 1
    for e, c in zip(eager, compiled):
        assert rel_err(c, e) < tol
