"""`rewy-hf bench` run in the test process, as its command line runs it."""

from __future__ import annotations

from rewy_hf import cli


def run_bench(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``rewy-hf bench *argv``."""
    code = cli.main(["bench", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err
