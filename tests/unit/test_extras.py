"""Optional dependencies: a missing one is an error that names the extra to install."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from unbroken.cli import main
from unbroken.extras import EXTRAS, MissingExtra, require


def _without(monkeypatch: pytest.MonkeyPatch, module: str, *packages: str) -> None:
    """Makes ``module`` unimportable and forgets ``packages`` so that they are imported afresh."""
    monkeypatch.setitem(sys.modules, module, None)
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in packages):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(("extra", "module"), [(e, m) for e, ms in EXTRAS.items() for m in ms])
def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch, extra: str, module: str) -> None:
    _without(monkeypatch, module)
    with pytest.raises(MissingExtra, match=rf"pip install 'unbroken\[{extra}\]'"):
        require(module, extra, "this")


def test_require_returns_an_installed_module() -> None:
    assert require("scipy", "sim", "this").__name__ == "scipy"


def test_require_rejects_a_module_its_extra_does_not_install() -> None:
    with pytest.raises(ValueError, match="not a module of the extra"):
        require("networkx", "report", "this")


@pytest.mark.parametrize(
    ("command", "module", "extra"),
    [
        (["plan", "--topology", "x.yaml", "--jobs", "y.yaml"], "networkx", "plan"),
        (["simulate", "goodput", "--help"], "scipy", "sim"),
        (["bench", "planner", "--help"], "networkx", "plan"),
    ],
)
def test_a_command_without_its_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, command: list[str], module: str, extra: str
) -> None:
    _without(monkeypatch, module, "unbroken.network", "unbroken.sim", "unbroken.bench")
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 1, result.output
    assert f"pip install 'unbroken[{extra}]'" in result.output
    listed = CliRunner().invoke(main, ["--help"])  # the other commands still work, this one is listed
    assert listed.exit_code == 0 and command[0] in listed.output
