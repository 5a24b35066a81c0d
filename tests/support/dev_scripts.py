"""The repository's developer scripts (dev/, not installed) as modules, for the tests that check them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

DEV = Path(__file__).resolve().parents[2] / "dev"


def load_dev_script(name: str) -> ModuleType:
    """dev/<name>.py, imported under its own name."""
    spec = importlib.util.spec_from_file_location(name, DEV / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
