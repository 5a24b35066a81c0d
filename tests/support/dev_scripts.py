"""The repository's developer scripts (dev/, not installed) as modules, for the tests that check them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DEV = Path(__file__).resolve().parents[2] / "dev"


def load_dev_script(name: str) -> ModuleType:
    """dev/<name>.py, imported under its own name."""
    spec = importlib.util.spec_from_file_location(name, DEV / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_dev_module(package: str, module: str) -> ModuleType:
    """dev/<package>/<module>.py, imported as ``package.module`` (the package once, under its own name, so
    that its modules import one another as they do when it runs)."""
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(package, DEV / package / "__init__.py",
                                                      submodule_search_locations=[str(DEV / package)])
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
    return importlib.import_module(f"{package}.{module}")
