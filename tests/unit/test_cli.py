"""The command line: every registered subcommand imports and answers --help."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from unbroken.cli import BENCHMARKS, COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name: str) -> None:
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_has_help(name: str) -> None:
    result = CliRunner().invoke(main, ["bench", name, "--help"])
    assert result.exit_code == 0, result.output


def test_unknown_command_is_a_clear_error() -> None:
    result = CliRunner().invoke(main, ["no-such-command"])
    assert result.exit_code != 0
    assert "No such command" in result.output
