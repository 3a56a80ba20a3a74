"""Imports point down the layers, and the environment is read in one place (docs/architecture.md).

Read from the source, not by importing: what a module imports lazily, inside a function, counts
the same as what it imports at the top.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import unbroken

PACKAGE = Path(unbroken.__file__).parent

# package -> packages it must never import (they sit above it)
FORBIDDEN = {
    "train": ("launch", "faults", "bench", "entry"),
    "comm": ("train", "launch", "faults", "bench"),
    "faults": ("launch", "train", "bench"),
    "checkpoint": ("train", "launch", "faults", "comm"),
    "wire": ("train", "launch", "faults", "comm", "checkpoint", "control"),
}


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_a_layer_above_it(package: str) -> None:
    wrong = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for module in _imports(path):
            for above in FORBIDDEN[package]:
                if module == f"unbroken.{above}" or module.startswith(f"unbroken.{above}."):
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not wrong, wrong


def test_the_environment_is_read_only_in_config() -> None:
    """Every setting is named, parsed and checked in unbroken/config.py; elsewhere the environment
    is only copied on to a child process or set."""
    read = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]+\](?!\s*=)|in os\.environ\b")
    found = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "config.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if read.search(line)
    ]
    assert not found, found
