"""`rewy-hf env`: versions, devices, rewy-hf's settings and which backends are usable."""

from __future__ import annotations

import argparse

from .options import STDOUT, write_json

HELP = "print versions, devices, rewy-hf's environment settings and which backends are usable"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="PATH",
                        help="write the report as JSON to PATH instead of the text; '-', or no PATH: to stdout")


def run(args: argparse.Namespace) -> int:
    from ..environment import collect_env, format_env

    report = collect_env()
    if args.json is None:
        print(format_env(report))
    else:
        write_json(args.json, report)
    return 0
