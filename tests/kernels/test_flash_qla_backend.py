"""The flash_qla backend and the rule that routes ``backend="auto"`` GDN calls to it, on CPU.

FlashQLA itself needs a Hopper GPU (tests/kernels/test_gpu_flash_qla.py runs it there). Here
a stand-in package (tests/support/fake_flash_qla.py: FlashQLA's two entry points computed by
the float64 reference) takes its place, so what is tested is rewy's side: the backend hands the
right tensors to FlashQLA's forward and backward and back (l2norm, GVA, packed sequences,
initial and final state, V-first layout), its fake implementation matches what it saves, it
compiles without a graph break, and the dispatch report says where each call went and why.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from compile_checks import assert_one_graph_with_eager_grads

import fake_flash_qla
from rewy_hf.kernels import flash_qla_route as route
from rewy_hf.kernels.core import CoreArgs, delta_rule
from rewy_hf.kernels.reference import naive_gated_delta_rule
from rewy_hf.patching.dispatch import dispatch_report, reset_dispatch_report
from rewy_hf.rel_error import rel_err


@pytest.fixture
def flash_qla(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_qla", fake_flash_qla)
    fake_flash_qla.calls.update(fwd=0, bwd=0)
    fake_flash_qla.splits.update(issued=0, reused=0, rebuilt=0)
    return fake_flash_qla


def _inputs(B=2, T=90, H=2, HV=2, K=16, V=16, cu=None, h0=False, v_first=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if cu is not None:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    r = lambda *s: torch.randn(*s, generator=gen)
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=F.logsigmoid(r(B, T, HV) + 2),
             beta=torch.rand(B, T, HV, generator=gen),
             h0=0.5 * r(*((N, HV, V, K) if v_first else (N, HV, K, V))) if h0 else None)
    return {n: None if t is None else t.requires_grad_() for n, t in x.items()}, \
        (None if cu is None else torch.tensor(cu, dtype=torch.long))


CASES = [pytest.param({}, id="plain"), pytest.param(dict(HV=4), id="gva"),
         pytest.param(dict(cu=[0, 30, 100, 170], h0=True), id="packed-h0"),
         pytest.param(dict(h0=True, v_first=True), id="h0-state_v_first"),
         pytest.param(dict(B=1, T=200, HV=4, h0=True, v_first=True), id="one-row-split")]


def _split_expected(x) -> int:
    """How many split caches the stand-in issues for these inputs (one row of two chunks or more)."""
    return int(x["v"].shape[0] == 1 and x["v"].shape[1] >= 2 * fake_flash_qla.CHUNK)


@pytest.mark.parametrize("qk_l2norm", [False, True])
@pytest.mark.parametrize("shape", CASES)
def test_backend_matches_float64_autograd_through_the_reference(flash_qla, shape, qk_l2norm):
    x, cu = _inputs(**shape)
    v_first = shape.get("v_first", False)
    a = CoreArgs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], cu, 16 ** -0.5, "gdn", "recompute",
                 v_first, qk_l2norm, False)
    o, ht = delta_rule(a, "flash_qla")
    assert o.dtype == x["v"].dtype and ht.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    names = [n for n, t in x.items() if t is not None]
    got = torch.autograd.grad((o, ht), [x[n] for n in names], (do, dht))

    ref_in = {n: x[n].detach().double().requires_grad_() for n in names}
    o_ref, ht_ref = naive_gated_delta_rule(ref_in["q"], ref_in["k"], ref_in["v"], ref_in["g"], ref_in["beta"],
                                           scale=16 ** -0.5, initial_state=ref_in.get("h0"),
                                           output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm,
                                           state_v_first=v_first, cu_seqlens=cu)
    want = torch.autograd.grad((o_ref, ht_ref), [ref_in[n] for n in names], (do.double(), dht.double()))
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ht, ht_ref) < 1e-5
    for n, g, w in zip(names, got, want):
        assert g.dtype == x[n].dtype and g.shape == x[n].shape, n
        assert rel_err(g, w) < 1e-5, (n, rel_err(g, w))
    assert flash_qla.calls == {"fwd": 1, "bwd": 1}
    # A split made by the forward reaches the backward intact, and the backward rebuilds none.
    n = _split_expected(x)
    assert flash_qla.splits == {"issued": n, "reused": n, "rebuilt": 0}


@pytest.mark.parametrize("shape", CASES[:3] + CASES[4:])
def test_fake_implementation_matches_what_the_backend_saves(flash_qla, shape):
    x, cu = _inputs(**shape)
    for qk_l2norm in (False, True):
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], cu, 16 ** -0.5, "gdn", "recompute", False,
                qk_l2norm, False, "", "", "flash_qla")
        result = torch.library.opcheck(torch.ops.rewy.delta_rule.default, args,
                                       test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        assert result == {name: "SUCCESS" for name in result} and len(result) == 3, result


def test_compiles_without_a_graph_break_and_gives_the_eager_gradients(flash_qla):
    x, _ = _inputs(T=70, HV=4)

    def f(q, k, v, g, beta):
        o, _ = delta_rule(CoreArgs(q, k, v, g, beta, None, None, None, 16 ** -0.5, "gdn", "recompute", False, True,
                                   False), "flash_qla")
        return (o * o).sum()

    leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]
    assert_one_graph_with_eager_grads(f, leaves)


def test_a_split_crosses_the_compiled_boundary(flash_qla):
    """One row: the forward's split (its segment count known only at run time) is saved by the
    compiled graph and handed to the backward intact, in one graph with the eager gradients."""
    def f(q, k, v, g, beta):
        o, _ = delta_rule(CoreArgs(q, k, v, g, beta, None, None, None, 16 ** -0.5, "gdn", "recompute", False, True,
                                   False), "flash_qla")
        return (o * o).sum()

    x, _ = _inputs(B=1, T=200)
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]
    assert_one_graph_with_eager_grads(f, leaves)
    assert flash_qla.splits["issued"] == flash_qla.splits["reused"] >= 2 and flash_qla.splits["rebuilt"] == 0


def test_a_split_of_another_layout_is_refused_with_the_fix(flash_qla, monkeypatch):
    """A flash-qla whose split cache is laid out otherwise than 0.1.3's would be saved under the
    wrong fake shapes, so the forward refuses it and names the fix."""
    from rewy_hf.errors import UnsupportedConfigError

    issue = fake_flash_qla._split

    def transposed(*args):
        cache = issue(*args)
        cache.num_warmup_bwd = cache.num_warmup_bwd.t().contiguous()
        return cache

    monkeypatch.setattr(fake_flash_qla, "_split", transposed)
    x, _ = _inputs(B=1, T=300, HV=4)
    a = CoreArgs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, 0.25, "gdn", "recompute", False, False,
                 False)
    with pytest.raises(UnsupportedConfigError, match=r"split_warmup of shape \(4, 3\).*expects \(3, 4\).*"
                                                     r"flash-qla 0\.1\.3.*backend='triton'"):
        delta_rule(a, "flash_qla")


def test_a_split_without_a_field_is_refused_with_the_fix(flash_qla, monkeypatch):
    """A flash-qla whose split cache has no entering states under 0.1.3's name gets the same refusal,
    not an AttributeError from inside rewy."""
    from rewy_hf.errors import UnsupportedConfigError

    issue = fake_flash_qla._split

    def renamed(*args):
        cache = issue(*args)
        cache.h_init = cache.__dict__.pop("h0")
        return cache

    monkeypatch.setattr(fake_flash_qla, "_split", renamed)
    x, _ = _inputs(B=1, T=300, HV=4)
    a = CoreArgs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, 0.25, "gdn", "recompute", False, False,
                 False)
    with pytest.raises(UnsupportedConfigError, match=r"split_h0 of shape None.*flash-qla 0\.1\.3.*backend='triton'"):
        delta_rule(a, "flash_qla")


def test_dispatch_report_says_where_a_call_went_and_why(flash_qla):
    x, _ = _inputs(T=64)
    reset_dispatch_report()
    a = CoreArgs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, 0.25, "gdn", "recompute", False, True,
                 False, "gated_delta_rule", "FlashQLA serves this call and is faster")
    o, _ = delta_rule(a, "flash_qla")
    o.sum().backward()
    e = dispatch_report()["ops"]["gated_delta_rule"]
    assert e["backends"] == {"flash_qla": 1} and e["optimized_backward_calls"] == 1
    assert e["routes"] == {"flash_qla: FlashQLA serves this call and is faster": 1}


# --- the rule -------------------------------------------------------------------------------------

def _meta(B=1, T=4096, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16, vdtype=None):
    q = torch.empty(B, T, H, K, dtype=dtype, device="meta")
    return q, q, torch.empty(B, T, HV, V, dtype=vdtype or dtype, device="meta")


def test_no_package_no_route():
    if route.environment_reason("meta", -1) != "flash-qla is not installed":
        pytest.skip("flash-qla is installed here")      # the GPU test covers the installed case
    q, k, v = _meta()
    assert route.choose(q, k, v, False) == ("triton", "flash-qla is not installed")


@pytest.fixture
def usable(monkeypatch):
    """As on a Hopper machine with flash-qla installed."""
    monkeypatch.setitem(route._PROBED, ("meta", -1), None)


@pytest.mark.parametrize("kw,neg,expect", [
    (dict(), False, "flash_qla"),
    (dict(B=2, T=8192, HV=16), False, "flash_qla"),
    (dict(B=4, T=4096, HV=16), False, "flash_qla"),
    (dict(B=1, T=16384, HV=16), False, "flash_qla"),
    (dict(dtype=torch.float32), False, "bfloat16 / float16"),
    (dict(vdtype=torch.float16), False, "bfloat16 / float16"),
    (dict(K=64, V=64), False, "K = V = 128, got K = 64"),
    (dict(), True, "allow_neg_eigval"),
])
def test_rule(usable, kw, neg, expect):
    q, k, v = _meta(**kw)
    backend, why = route.choose(q, k, v, neg)
    if expect == "flash_qla":
        assert backend == "flash_qla" and why == "FlashQLA serves this call and is faster"
    else:
        assert backend == "triton" and expect in why, why
