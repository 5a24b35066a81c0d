"""The packed bench's count of Triton builds and autotune picks walks every object the garbage
collector tracks, so it has to survive whatever else the process holds."""

import gc
import weakref

import pytest
import triton
import triton.language as tl

from rewy_hf.bench.triton_builds import built_and_tuned


class _Referent:
    pass


@triton.autotune(configs=[triton.Config({})], key=["n"])
@triton.jit
def _tuned_kernel(x_ptr, n):
    tl.store(x_ptr, n)


def test_counts_a_new_autotune_pick():
    before = built_and_tuned()
    _tuned_kernel.cache[("rewy-hf-test-key",)] = triton.Config({})
    try:
        assert built_and_tuned() == (before[0], before[1] + 1)
    finally:
        del _tuned_kernel.cache[("rewy-hf-test-key",)]


def test_a_dead_weak_proxy_among_the_objects_does_not_stop_the_count():
    # a weak proxy whose referent is gone: reading __class__ through it raises
    before = built_and_tuned()
    referent = _Referent()
    held = [weakref.proxy(referent)]
    del referent
    gc.collect()
    with pytest.raises(ReferenceError):
        held[0].__class__
    assert any(type(o) is weakref.ProxyType for o in gc.get_objects())
    assert built_and_tuned() == before
