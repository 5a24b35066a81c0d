"""Every recipe test starts from a fresh Accelerate state: a run leaves its state behind in the process."""

import pytest

from support.recipe_runs import reset_accelerate


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    reset_accelerate()
