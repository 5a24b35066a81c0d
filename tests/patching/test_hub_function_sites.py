"""Sites whose module-level function is a Hugging Face ``kernels`` function module (transformers >= 5.25
with ``kernels`` installed): rewy finds the function inside, and its stand-in keeps kernels' unpickling
of a layer's private copy working. The function modules here are built the way ``kernels`` builds them
(an ``nn.Module`` class with ``kernel_layer_name`` whose ``forward`` calls the function it closes over),
so the checks do not depend on which transformers is installed; test_patch_pickle.py and
test_compile.py run the installed transformers' own."""

from __future__ import annotations

import functools

import pytest
import torch

from rewy_hf.adapters.transformers_common import hub_function, is_hub_function, plain_torch, runs_torch_fallback
from rewy_hf.patching.dispatch import CoreDispatcher, make_dispatcher


def _function_module(func):
    class Func(torch.nn.Module):
        kernel_layer_name = func.__name__

        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


def _kernel_or_fallback(torch_function, is_new_implementation):
    """transformers' wrapper: the package's kernel when one was found at import, else the torch function."""
    @functools.wraps(torch_function)
    def wrapped(*args, **kwargs):
        if is_new_implementation:
            raise AssertionError("a kernel package would run here")
        return torch_function(*args, **kwargs)

    return wrapped


def add_one(x):
    return x + 1


def test_the_function_inside_a_function_module_is_found():
    module = _function_module(add_one)
    assert hub_function(module) is add_one and is_hub_function(module)
    assert hub_function(add_one) is add_one and not is_hub_function(add_one)
    linear = torch.nn.Linear(2, 2)                  # a module, but no kernels function module
    assert hub_function(linear) is linear and not is_hub_function(linear)


def test_the_torch_fallback_is_seen_through_a_function_module():
    fallback = _function_module(_kernel_or_fallback(add_one, is_new_implementation=False))
    kernel = _function_module(_kernel_or_fallback(add_one, is_new_implementation=True))
    assert plain_torch(fallback) is add_one and plain_torch(kernel) is add_one
    assert runs_torch_fallback(fallback) and not runs_torch_fallback(kernel)
    assert not runs_torch_fallback(_function_module(add_one))      # no transformers wrapper inside


def test_a_stand_in_for_a_function_module_rebuilds_the_module_type():
    module = _function_module(_kernel_or_fallback(add_one, is_new_implementation=False))
    stand_in = make_dispatcher(module, "some.module:add_one", "core")
    assert isinstance(stand_in, CoreDispatcher) and stand_in.original is module
    # kernels' unpickling of a layer's private copy: type(<the module-level name>)()
    rebuilt = type(stand_in)()
    assert type(rebuilt) is type(module) and rebuilt is not module
    # the function module's nn.Module state is not copied onto the stand-in as function attributes
    assert "_parameters" not in vars(stand_in)
    # unpatched, the stand-in calls the original (no patched layer is running)
    assert stand_in(torch.tensor(1.0)).item() == 2.0
    # a second stand-in for the same module type (patch, unpatch, patch again) reuses its class
    assert type(make_dispatcher(module, "some.module:add_one", "core")) is type(stand_in)


def test_a_stand_in_for_a_plain_function_is_a_plain_core_dispatcher():
    stand_in = make_dispatcher(add_one, "some.module:add_one", "core")
    assert type(stand_in) is CoreDispatcher and stand_in.__wrapped__ is add_one
    with pytest.raises(TypeError, match="original"):
        CoreDispatcher()
