"""Running a Python script in this process, as ``python script.py ARGS...`` would.

``__name__ == "__main__"``, ``sys.argv == [script.py, *ARGS]``, the script's
folder first on ``sys.path``; its exit status and traceback come back as
values instead of ending the process, and ``sys.argv`` / ``sys.path`` are
restored however it ends.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from pathlib import Path

# Exit status when the script file cannot be opened (python's own choice).
EXIT_NO_SCRIPT = 2


@contextlib.contextmanager
def _script_environment(script: Path, argv: list[str]):
    saved_argv = sys.argv[:]
    folder = os.path.dirname(os.path.realpath(script))  # as python does for `python script.py`
    sys.argv = [str(script), *argv]
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        else:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)


def _script_traceback(exc: BaseException, script: Path) -> str:
    """The traceback from the script's first frame on, as python would print it."""
    tb = exc.__traceback__
    target = os.path.realpath(script)
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _exit_code(exc: SystemExit) -> tuple[int, str | None]:
    """Status and stderr message for ``sys.exit(code)``, as the interpreter maps them."""
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, bool):
        return int(code), None
    if isinstance(code, int):
        return code, None
    return 1, str(code)


def run_script(script: Path, argv: list[str]) -> tuple[int, str | None]:
    """Run ``script`` as __main__; returns (exit status, error text or None)."""
    with _script_environment(script, argv):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:
            status, message = _exit_code(exc)
            if message is not None:
                print(message, file=sys.stderr)
            return status, (None if status == 0 else f"SystemExit({exc.code!r})")
        except KeyboardInterrupt as exc:
            text = _script_traceback(exc, script)
            sys.stderr.write(text)
            return 130, text
        except BaseException as exc:  # noqa: BLE001 - the script's failure is our result
            text = _script_traceback(exc, script)
            sys.stderr.write(text)
            return 1, text
    return 0, None
