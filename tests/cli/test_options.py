"""Words the commands share mean one thing everywhere: --backend is rewy's backend
(auto|torch|triton), dtypes are spelt as torch spells them, every --help shows the
defaults, and --json - writes nothing but the JSON to stdout."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest
import torch

from rewy_hf import cli
from rewy_hf.cli.options import HelpFormatter
from rewy_hf.training.options import build_parser as recipe_parser
from rewy_hf.validation import BACKENDS

# What each parser needs on its command line to parse at all (run: the script), and its positionals.
REQUIRED = {"run": ["script.py"]}
POSITIONALS = {"run": {"script", "script_args"}}


def _command_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"rewy-hf {name}", formatter_class=HelpFormatter)
    importlib.import_module(cli.COMMANDS[name]).add_arguments(parser)
    return parser


PARSERS = {name: (lambda n=name: _command_parser(n)) for name in cli.COMMANDS} | {"recipe": recipe_parser}


def _help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help entry (its flag line and continuation lines), whitespace collapsed, by flag."""
    entries: dict[str, list[str]] = {}
    current = None
    for line in parser.format_help().splitlines():
        stripped = line.strip()
        if line.startswith("  -") and not line.startswith("   "):
            current = stripped.split()[0].split(",")[0]
            entries[current] = [stripped]
        elif current and line.startswith("    ") and stripped:
            entries[current].append(stripped)
        else:
            current = None
    return {flag: " ".join(" ".join(parts).split()) for flag, parts in entries.items()}


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_help_shows_the_defaults(name):
    parser = PARSERS[name]()
    defaults = vars(parser.parse_args(REQUIRED.get(name, [])))
    entries = _help_entries(parser)
    for dest, default in defaults.items():
        if default is None or default is False or dest in POSITIONALS.get(name, ()):
            continue          # flags, and options whose help says what leaving them out does
        flag = "--" + dest.replace("_", "-")
        assert f"(default: {default})" in entries[flag], (flag, entries[flag])


@pytest.mark.parametrize("name", ["bench", "parity", "run", "recipe"])
def test_backend_means_rewys_backend(name):
    parser = PARSERS[name]()
    args = parser.parse_args(REQUIRED.get(name, []))
    assert args.backend == "auto"
    for backend in BACKENDS:
        assert parser.parse_args(["--backend", backend, *REQUIRED.get(name, [])]).backend == backend
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "optimized", *REQUIRED.get(name, [])])


@pytest.mark.parametrize("name", ["bench", "parity"])
def test_dtypes_are_spelt_as_torch_spells_them(name, capsys):
    parser = PARSERS[name]()
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "no-such-dtype"])
    choices = capsys.readouterr().err.split("choose from")[1].strip().rstrip(")").replace("'", "").split(", ")
    assert "float32" in choices and "bfloat16" in choices
    assert all(isinstance(getattr(torch, c), torch.dtype) for c in choices), choices
    for short in ("bf16", "fp32", "fp16"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--dtype", short])


def test_verify_json_to_stdout_is_only_json(capsys):
    assert cli.main(["verify", "--only", "env", "--json", "-"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["ok"] is True and {c["group"] for c in data["checks"]} == {"env"}
    assert "PASS  FLA version pin" in out.err and "checks passed" in out.err
