"""FLA's optional backends, as the bench sees them: which are on, and which served a call. FLA 0.6.0
routes some functions to FlashQLA or TileLang when they are installed, through registries of backends
it asks before its own Triton code (``fla/backends.py``). The registries are found by feature
detection: an FLA without them has none, and ``registries()`` is then empty."""

from __future__ import annotations

import contextlib
from typing import Iterator


def registries() -> list:
    """FLA's backend registries (each with its ``_backends`` by type), or [] where FLA has none."""
    try:
        import fla.backends as fb
    except ImportError:
        return []
    found = list(getattr(fb, "_operation_registries", {}).values()) + list(getattr(fb, "_function_registries",
                                                                               {}).values())
    return [r for r in found if isinstance(getattr(r, "_backends", None), dict)]


def active_backends() -> dict[str, list[str]]:
    """Per registry (FLA's operation name), the backends that are installed and switched on."""
    out: dict[str, list[str]] = {}
    for reg in registries():
        on = [name for name, b in reg._backends.items() if b.is_available() and b.is_enabled()]
        if on:
            out.setdefault(reg.operation_name, []).extend(on)
    return out


@contextlib.contextmanager
def recording_served() -> Iterator[set[str]]:
    """The set of "operation.function -> backend" that FLA's dispatch sent to a backend inside
    this block (empty: FLA's own Triton code ran everything)."""
    served: set[str] = set()
    patched = []
    for reg in registries():
        for name, b in reg._backends.items():
            original = b.get_implementation

            def spy(function_name, _original=original, _op=reg.operation_name, _name=name):
                impl = _original(function_name)
                if impl is not None:
                    served.add(f"{_op}.{function_name} -> {_name}")
                return impl

            b.get_implementation = spy
            patched.append(b)
    try:
        yield served
    finally:
        for b in patched:
            del b.get_implementation        # the instance attribute: the class's method shows again
