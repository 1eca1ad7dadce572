"""`strata COMMAND --help` reads like llama.cpp's: grouped, one line an option, plain metavars; an
unknown flag is one line naming the command that met it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from strata_core.cli import main


@pytest.fixture
def strata(capsys: pytest.CaptureFixture[str]):
    """``strata(*args)``: the command's exit status and output, run in this process."""

    def run(*args: str) -> SimpleNamespace:
        handlers = list(logging.root.handlers)
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse: --help, unknown flags
            code = exit_.code
        finally:
            logging.root.handlers[:] = handlers
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


@pytest.mark.parametrize(("command", "groups"), [
    ("generate", ["model:", "placement:", "experts:", "sampling:", "debug:"]),
    ("serve", ["model:", "placement:", "experts:", "server:", "debug:"]),
])
def test_help_is_short_grouped_and_plain(strata, command: str, groups: list[str]) -> None:
    result = strata(command, "--help")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert len(lines) <= 46, result.stdout  # a screen (serve: the ranks flags take one line of it)
    assert all(group in lines for group in groups)
    for python_type in ("dict[", "list[", "SecretStr", "default factory", "None}", "{int", "{float", " int ",
                        " float "):
        assert python_type not in result.stdout
    assert lines[0].startswith(f"usage: strata {command} [-m PATH] [-c N]") and lines[0].endswith("[options]")
    assert "--no-dbg-nan" not in result.stdout and "--dbg-nan" in result.stdout  # off by default: --x only
    assert "--no-cuda-graphs" in result.stdout and "--cuda-graphs " not in result.stdout  # on: --no-x only
    assert "--expert-cache-gib GiB" in result.stdout and "-m, --model PATH" in result.stdout


def test_help_all_describes_every_option(strata) -> None:
    full = strata("generate", "--help-all")
    assert full.returncode == 0
    assert "-c, --max-context, --ctx-size N" in full.stdout
    assert "cuBLAS's 64-row kernel" in full.stdout  # --batch-invariant's whole text
    assert "turns off: capture decode windows as CUDA graphs" in full.stdout
    assert "default factory" not in full.stdout and "dict[" not in full.stdout


def test_both_forms_of_a_switch_are_still_accepted(strata, tiny_model_factory) -> None:
    model = str(tiny_model_factory(expert_type="Q8_0"))
    for flag in ("--cuda-graphs", "--no-cuda-graphs", "--no-chat"):
        result = strata("generate", "-m", model, "-p", "The", "-n", "1", "--temperature", "0", flag)
        assert result.returncode == 0, (flag, result.stderr)


@pytest.mark.parametrize("args", [("generate", "--bogus-flag"), ("bench", "serve", "--bogus-flag", "1")])
def test_an_unknown_flag_is_one_line_naming_its_command(strata, args: tuple[str, ...]) -> None:
    result = strata(*args)
    command = "strata " + " ".join(a for a in args if not a.startswith("-") and a != "1")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"strata: error: unrecognized arguments: {' '.join(args[len(command.split()) - 1:])} "
        f"(see `{command} --help`)"]
    assert "usage:" not in result.stderr + result.stdout


def test_a_flag_without_its_value_is_one_line_naming_its_command(strata) -> None:
    result = strata("generate", "--max-tokens")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "--max-tokens" in result.stderr and "expected one argument" in result.stderr
    assert "strata generate --help" in result.stderr
