"""A patched model under transformers' activation checkpointing (its default: non-reentrant).

The recomputed forward reaches rewy again, and the gradients equal those of the same model
without checkpointing. Non-reentrant checkpointing recomputes on every read of an autograd
Function's saved tensors and refuses a second read, so the core's backward must read them once.
"""

from __future__ import annotations

import pytest

from rewy_hf import dispatch_report, patch_model, reset_dispatch_report, unpatch_model
from rewy_hf.rel_error import rel_err

import hf_tiny_models as hf
from test_compile import BUILDERS, grads_rel


@pytest.mark.parametrize("family", list(BUILDERS))
def test_checkpointed_patched_model_matches_the_unchecked_one(family):
    model = BUILDERS[family]()
    twin = hf.twin(model)
    model.activation_checkpointing_enable()              # transformers' default kwargs
    patch_model(model, backend="torch")
    patch_model(twin, backend="torch")
    ids = hf.input_ids(2, 70)
    reset_dispatch_report()
    loss = hf.loss_of(model, ids, family)
    loss.backward()
    counts = dispatch_report()["ops"][hf.FAMILIES[family].op]
    # two delta-rule layers: each forward runs twice (the second time in the recompute), each backward once
    assert counts["forward_calls"] == 4 and counts["optimized_backward_calls"] == 2, counts
    ref = hf.loss_of(twin, ids, family)
    ref.backward()
    assert rel_err(loss, ref) <= 1e-6
    assert grads_rel(model, twin) <= 1e-5
    # the tests after this one see the module-level sites as no patched model holds them
    unpatch_model(model)
    unpatch_model(twin)
