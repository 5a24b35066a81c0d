"""The `rewy-hf` command line.

Each subcommand lives in its own module of this package, listed in
``COMMANDS``; it parses and prints, and the work is done by the engine it
calls (``rewy_hf.bench``, ``rewy_hf.parity``, ``rewy_hf.verify``, ...). A
command module provides:

    HELP: str                       one line for `rewy-hf --help`
    add_arguments(parser) -> None   add its options to its subparser
    run(args) -> int                do the work, return the exit status

Command modules keep heavy imports (FLA, transformers) inside ``run`` so that
`rewy-hf --help` stays quick. A new command is a module and one line here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from ..environment import rewy_hf_version
from .options import HelpFormatter

COMMANDS: dict[str, str] = {
    "env": "rewy_hf.cli.env",
    "demo": "rewy_hf.cli.demo",
    "parity": "rewy_hf.cli.parity",
    "verify": "rewy_hf.cli.verify",
    "run": "rewy_hf.cli.run",
    "bench": "rewy_hf.cli.bench",
}


class CommandParser(argparse.ArgumentParser):
    # argparse prints only the usage line on errors; a newcomer who mistypes
    # a subcommand is better served by the full list of commands.
    def error(self, message: str):
        self.print_help(sys.stderr)
        self.exit(2, f"\n{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="rewy-hf", formatter_class=HelpFormatter,
        description="Faster backward passes for delta-rule attention in Hugging Face models.",
    )
    parser.add_argument("--version", action="version", version=f"rewy-hf {rewy_hf_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=HelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(run_command=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # FLA warns on import that it found no GPU; the commands say what they run on themselves.
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # --help/--version/usage errors exit through argparse; callers of
        # main() (tests, the console script) want a status, not an exception.
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.run_command(args))
