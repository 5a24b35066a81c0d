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
def test_backend_means_rewys_backend(name, capsys):
    parser = PARSERS[name]()
    args = parser.parse_args(REQUIRED.get(name, []))
    assert args.backend == "auto"
    for backend in BACKENDS:
        assert parser.parse_args(["--backend", backend, *REQUIRED.get(name, [])]).backend == backend
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "optimized", *REQUIRED.get(name, [])])
    assert "invalid choice: 'optimized'" in capsys.readouterr().err


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


# The counts the commands share: --steps, --seq-len and --batch-size of parity and of
# bench's model level. Each is checked at parse time, as a usage error (exit 2) that
# names the flag and its minimum, before anything is loaded or reshaped.
COUNTS = [(command, flag) for command in ("parity", "bench") for flag in ("--steps", "--seq-len", "--batch-size")]


@pytest.mark.parametrize("command,flag", COUNTS)
@pytest.mark.parametrize("value", ["0", "-1", "-5"])
def test_counts_below_one_are_usage_errors_naming_the_flag(command, flag, value, capsys):
    assert cli.main([command, "--model", "tiny-qwen3.5", flag, value]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == f"rewy-hf {command}: error: argument {flag}: {value} is below the minimum of 1"


@pytest.mark.parametrize("command,flag", COUNTS)
def test_counts_must_be_integers(command, flag, capsys):
    assert cli.main([command, "--model", "tiny-qwen3.5", flag, "two"]) == 2
    assert f"error: argument {flag}: 'two' is not an integer" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["parity", "bench", "verify"])
def test_device_is_cuda_or_cpu_everywhere(command, capsys):
    from rewy_hf.cli.options import DEVICES

    (action,) = [a for a in PARSERS[command]()._actions if "--device" in a.option_strings]
    assert tuple(action.choices) == DEVICES and action.default is None
    assert cli.main([command, "--device", "nonsense"]) == 2
    assert "error: argument --device: invalid choice: 'nonsense' (choose from 'cuda', 'cpu')" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["parity", "bench", "verify"])
def test_cuda_without_a_gpu_is_exit_2_suggesting_cpu(command, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [command, "--device", "cuda"] + (["--model", "tiny-qwen3.5"] if command == "parity" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--device cuda, but torch sees no CUDA device; use --device cpu" in err
    assert "--reference" not in err
