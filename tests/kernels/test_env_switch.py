"""kernels/env_switch.py: a 0 / 1 switch, its default when unset or empty, and an error for anything else."""

from __future__ import annotations

import pytest

from rewy_hf.kernels.env_switch import flag


@pytest.mark.parametrize("default", [True, False])
def test_unset_and_empty_give_the_default_and_0_1_override_it(default, monkeypatch):
    monkeypatch.delenv("REWY_HF_TEST_SWITCH", raising=False)
    assert flag("REWY_HF_TEST_SWITCH", default, on="a", off="b") is default
    for text, value in (("", default), (" 1 ", True), ("0", False)):
        monkeypatch.setenv("REWY_HF_TEST_SWITCH", text)
        assert flag("REWY_HF_TEST_SWITCH", default, on="a", off="b") is value


def test_other_values_name_both_settings_default_first(monkeypatch):
    monkeypatch.setenv("REWY_HF_TEST_SWITCH", "true")
    with pytest.raises(ValueError, match=r"REWY_HF_TEST_SWITCH='true' is not understood; use 1 \(fast, the default\) "
                                         r"or 0 \(slow\)"):
        flag("REWY_HF_TEST_SWITCH", True, on="fast", off="slow")
    with pytest.raises(ValueError, match=r"use 0 \(slow, the default\) or 1 \(fast\)"):
        flag("REWY_HF_TEST_SWITCH", False, on="fast", off="slow")
