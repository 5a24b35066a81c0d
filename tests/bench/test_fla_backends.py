"""FLA's backend dispatch as the bench sees it (rewy_hf/bench/fla_backends.py), and turned off for
dev/bench_lab's fla-triton peer (dev/bench_lab/peers.py), on FLA's own registry machinery: a registry
with one backend that serves a function, as FlashQLA or TileLang serve FLA's functions where they are
installed."""

from __future__ import annotations

import pytest
import torch

from dev_scripts import load_dev_module

from rewy_hf.bench import fla_backends

dispatch_off = load_dev_module("bench_lab", "peers").dispatch_off


@pytest.fixture
def served_function(monkeypatch):
    """A function dispatched through a registry "rewy_test_op" whose one backend "peer" serves it."""
    import fla.backends as fb

    class Peer(fb.BaseBackend):
        backend_type = "peer"

        def double(self, x):
            return 3 * x                # tells apart who ran

    registry = fb.BackendRegistry("rewy_test_op")
    registry.register(Peer())
    monkeypatch.setitem(fb._operation_registries, "rewy_test_op", registry)

    def double(x):
        return 2 * x

    return registry.dispatch(double)


def test_fla_as_installed_runs_the_backend_and_says_so(served_function):
    assert fla_backends.active_backends()["rewy_test_op"] == ["peer"]
    with fla_backends.recording_served() as served:
        assert served_function(torch.ones(1)).item() == 3
    assert served == {"rewy_test_op.double -> peer"}
    # the spies are gone afterwards: a later call adds nothing to the set they wrote into
    served.clear()
    assert served_function(torch.ones(1)).item() == 3
    assert served == set()


def test_dispatch_off_runs_flas_own_code_and_restores_the_registries(served_function):
    before = {id(r): dict(r._backends) for r in fla_backends.registries()}
    with fla_backends.recording_served() as served, dispatch_off():
        assert served_function(torch.ones(1)).item() == 2
        assert not fla_backends.active_backends()
    assert served == set()
    assert {id(r): dict(r._backends) for r in fla_backends.registries()} == before
    assert served_function(torch.ones(1)).item() == 3


def test_dispatch_off_restores_after_an_error(served_function):
    with pytest.raises(RuntimeError, match="boom"), dispatch_off():
        raise RuntimeError("boom")
    assert served_function(torch.ones(1)).item() == 3
