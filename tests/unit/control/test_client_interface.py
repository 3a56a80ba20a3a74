"""Stand-ins for CoordinatorClient in tests keep the real client's interface.

A fake coordinator client that drifted from the real one (a parameter renamed, a default
changed) lets a Manager test pass against calls the real client would refuse. Read from the
source, not by importing the test modules: every class under ``tests/`` that defines
``request_quorum`` is such a stand-in, and each method it defines must have the real one's
signature; the real client in turn must match :class:`~unbroken.control.client.QuorumClient`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unbroken

PACKAGE = Path(unbroken.__file__).parent
TESTS = Path(__file__).resolve().parents[2]


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, str]:
    """Public method name -> its signature as written (parameters, defaults, annotations, return)."""
    out = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            returns = ast.unparse(node.returns) if node.returns else ""
            out[node.name] = f"({ast.unparse(node.args)}) -> {returns}"
    return out


CLIENT = _classes(PACKAGE / "control" / "client.py")
REAL = _methods(CLIENT["CoordinatorClient"])


def _fakes() -> dict[str, ast.ClassDef]:
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        for name, cls in _classes(path).items():
            if "request_quorum" in _methods(cls):
                found[f"{path.relative_to(TESTS)}::{name}"] = cls
    return found


def test_the_real_client_matches_the_protocol_the_manager_uses() -> None:
    protocol = CLIENT["QuorumClient"]
    wanted = _methods(protocol)
    assert wanted and {m: REAL.get(m) for m in wanted} == wanted
    init = next(n for n in CLIENT["CoordinatorClient"].body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute)
    }
    fields = {n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert fields and fields <= assigned, fields - assigned


def test_every_fake_coordinator_client_in_the_tests_has_the_real_signatures() -> None:
    drifted = {
        f"{where}.{name}": (sig, REAL.get(name))
        for where, cls in _fakes().items()
        for name, sig in _methods(cls).items()
        if REAL.get(name) != sig
    }
    assert not drifted, f"fakes that no longer match CoordinatorClient (theirs, the real one): {drifted}"


def test_the_scan_tells_a_drifted_fake() -> None:
    """The comparison above can fail: a fake with a renamed parameter is caught."""
    fake = ast.parse(
        "class Fake:\n" "    def request_quorum(self, step: int, failed: int | None = None) -> None: ...\n"
    ).body[0]
    assert isinstance(fake, ast.ClassDef)
    assert _methods(fake)["request_quorum"] != REAL["request_quorum"]
