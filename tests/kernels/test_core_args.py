"""The core's record and its boundary's plumbing, on CPU (torch backend).

``CoreArgs`` travels flattened through the custom ops: the registered schemas must name its
fields in order, ``from_flat`` must undo ``tensors()`` / ``settings()``, and a signature that
drifts from the dataclass must be refused at import. The listeners registered with
``add_listener`` must hear each forward and backward of a reported call once, eager or compiled,
and nothing of a call without ``report_as``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rewy_hf.kernels import core
from rewy_hf.kernels.core_args import (GRADIENT_FIELDS, SETTING_FIELDS, TENSOR_FIELDS, CoreArgs,
                                       gradients_by_field)


def _args(report_as: str = "", family: str = "gdn", T: int = 70) -> CoreArgs:
    gen = torch.Generator().manual_seed(T)
    B, H, K, V = 1, 2, 8, 8
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return CoreArgs(q=F.normalize(r(B, T, H, K), dim=-1).requires_grad_(),
                    k=F.normalize(r(B, T, H, K), dim=-1).requires_grad_(), v=r(B, T, H, V).requires_grad_(),
                    g=F.logsigmoid(r(B, T, H)).requires_grad_() if family == "gdn" else None,
                    beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64).requires_grad_(), w=None, h0=None,
                    cu_seqlens=None, scale=K ** -0.5, family=family, policy="recompute", state_v_first=False,
                    qk_l2norm=False, safe_gate=False, report_as=report_as)


def test_the_fields_split_into_tensors_and_settings_in_field_order():
    names = tuple(f.name for f in dataclasses.fields(CoreArgs))
    assert TENSOR_FIELDS + SETTING_FIELDS == names
    assert TENSOR_FIELDS == ("q", "k", "v", "g", "beta", "w", "h0", "cu_seqlens")
    assert GRADIENT_FIELDS == tuple(n for n in TENSOR_FIELDS if n != "cu_seqlens")


def test_from_flat_undoes_the_flattening_and_refuses_a_wrong_count():
    a = _args(report_as="gated_delta_rule")
    b = CoreArgs.from_flat(a.tensors(), a.settings())
    assert all(getattr(b, f.name) is getattr(a, f.name) for f in dataclasses.fields(CoreArgs))
    with pytest.raises(ValueError, match="CoreArgs takes 8 tensors"):
        CoreArgs.from_flat(a.tensors()[:-1], a.settings())


def test_gradients_go_to_their_fields():
    grads = tuple(f"d{n}" for n in GRADIENT_FIELDS)
    by_field = dict(zip(TENSOR_FIELDS, gradients_by_field(grads)))
    assert by_field["cu_seqlens"] is None
    assert all(by_field[n] == f"d{n}" for n in GRADIENT_FIELDS)


@pytest.mark.parametrize("op,extra", [("delta_rule", ()), ("delta_rule_backward", ("saved", "do", "dht"))])
def test_registered_schemas_name_the_fields_in_order(op, extra):
    schema = getattr(torch.ops.rewy, op).default._schema
    expected = TENSOR_FIELDS + extra + SETTING_FIELDS + ("backend",)
    assert tuple(arg.name for arg in schema.arguments) == expected


def test_a_signature_that_drifts_from_the_fields_is_refused():
    def drifted(q, k, v, g, beta, w, h0, cu_seqlens, scale, policy, family, state_v_first, qk_l2norm, safe_gate,
                report_as, why, backend):
        pass

    with pytest.raises(TypeError, match="do not follow CoreArgs' fields"):
        core._spelled_as(TENSOR_FIELDS + SETTING_FIELDS + ("backend",))(drifted)


class _Heard:
    def __init__(self):
        self.events: list[tuple] = []

    def forward(self, op, backend, policy, why):
        self.events.append(("forward", op, backend, policy))

    def backward(self, op, backend, policy, why):
        self.events.append(("backward", op, backend, policy))


@pytest.fixture
def heard():
    listener = _Heard()
    core.add_listener(listener)
    core.add_listener(listener)            # a second registration changes nothing
    yield listener
    core.remove_listener(listener)


def _run(a: CoreArgs, compiled: bool) -> None:
    def step(q, k, v, g, beta):
        o, _ = core.delta_rule(dataclasses.replace(a, q=q, k=k, v=v, g=g, beta=beta), "torch")
        return o

    fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
    inputs = (a.q, a.k, a.v, a.g, a.beta)
    fn(*inputs).square().sum().backward()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_listeners_hear_each_reported_forward_and_backward_once(heard, compiled):
    _run(_args(report_as="gated_delta_rule"), compiled)
    assert heard.events == [("forward", "gated_delta_rule", "torch", "recompute"),
                            ("backward", "gated_delta_rule", "torch", "recompute")]
    heard.events.clear()
    _run(_args(), compiled)
    assert heard.events == []


def test_a_removed_listener_hears_nothing_and_a_listener_needs_both_methods():
    listener = _Heard()
    core.add_listener(listener)
    core.remove_listener(listener)
    _run(_args(report_as="gated_delta_rule"), compiled=False)
    assert listener.events == []
    with pytest.raises(TypeError, match=r"lacks \['backward'\]"):
        core.add_listener(type("OnlyForward", (), {"forward": lambda self, *a: None})())


class _StateGradients:
    """Wraps a backend: records the state gradient each backward receives."""

    def __init__(self, backend):
        self.backend, self.seen = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def backward(self, a, saved, do, dht):
        self.seen.append(dht)
        return self.backend.backward(a, saved, do, dht)


@pytest.mark.parametrize("use_state", [False, True], ids=["state-unused", "state-in-loss"])
def test_compiled_backward_gets_the_state_gradient_eager_gets(monkeypatch, use_state):
    """Compiled, an unused final state reaches the backend's backward as None, as eagerly (AOTAutograd
    would otherwise hand it zeros, and the backward would run its state-gradient kernels for nothing);
    a used one reaches it as its gradient, and the input gradients equal the eager ones."""
    spies = {}
    real = core._backend
    monkeypatch.setattr(core, "_backend", lambda name: spies.setdefault(name, _StateGradients(real(name))))
    a = _args()

    def step(q, k, v, g, beta):
        o, ht = core.delta_rule(dataclasses.replace(a, q=q, k=k, v=v, g=g, beta=beta), "torch", final_state=use_state)
        return o.square().sum() + (ht.sum() if use_state else 0)

    inputs = (a.q, a.k, a.v, a.g, a.beta)
    grads = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
        grads[compiled] = torch.autograd.grad(fn(*inputs), inputs)
    seen = spies["torch"].seen
    assert len(seen) == 2
    if use_state:
        assert all(d is not None for d in seen)
        torch.testing.assert_close(seen[1].reshape(seen[0].shape), seen[0], rtol=0, atol=0)
    else:
        assert seen == [None, None]
    for eager, compiled in zip(grads[False], grads[True]):
        torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)
