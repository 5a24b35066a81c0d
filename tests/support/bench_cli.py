"""`rewy-hf bench` and the developer bench (dev/bench_lab) run in the test process, as their command
lines run them."""

from __future__ import annotations

from dev_scripts import load_dev_module

from rewy_hf import cli


def run_bench(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``rewy-hf bench *argv``."""
    code = cli.main(["bench", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def lab_main(argv: list[str]) -> int:
    """The exit status of ``python dev/bench_lab *argv`` (a usage error's too)."""
    try:
        return load_dev_module("bench_lab", "command").main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2


def run_lab(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python dev/bench_lab *argv``."""
    code = lab_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err
