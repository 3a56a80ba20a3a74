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
    # The coordinator's layer sits above diagnosis and observe: `unbroken status` lives in control/.
    "diagnosis": ("control", "train", "comm", "launch", "faults", "bench", "cluster", "checkpoint"),
    "observe": ("control", "diagnosis", "train", "comm", "launch", "faults", "bench", "cluster", "checkpoint"),
    # Rendering manifests is pure: it runs nothing, and names the commands it renders by their flags.
    "k8s": ("train", "comm", "control", "launch", "faults", "bench", "cluster", "checkpoint", "diagnosis", "observe"),
}

# control/'s rooms, lowest first: each may import the ones before it, never one after it nor the
# modules at control/'s top (the coordinator, its client, its command line, `unbroken status`).
CONTROL_ROOMS = ("state", "protocol", "quorum", "nodes")
CONTROL_TOP = ("coordinator", "coordinator_cli", "client", "status", "standby")


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


@pytest.mark.parametrize("room", CONTROL_ROOMS)
def test_controls_rooms_import_only_the_rooms_below_them(room: str) -> None:
    above = CONTROL_ROOMS[CONTROL_ROOMS.index(room) + 1 :] + CONTROL_TOP
    wrong = []
    for path in sorted((PACKAGE / "control" / room).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            names = [a.name for a in node.names] if node.module == "unbroken.control" else []
            reached = {node.module.split(".")[2]} if node.module.startswith("unbroken.control.") else set(names)
            wrong += [f"{path.relative_to(PACKAGE)} imports unbroken.control.{r}" for r in sorted(reached & set(above))]
    assert not wrong, wrong


def test_no_room_of_control_holds_more_than_a_dozen_modules_or_one_over_600_lines() -> None:
    for room in CONTROL_ROOMS:
        modules = sorted((PACKAGE / "control" / room).glob("*.py"))
        assert len(modules) <= 12, (room, len(modules))
        long = [f"{m.relative_to(PACKAGE)}: {n}" for m in modules if (n := len(m.read_text().splitlines())) > 600]
        assert not long, long


# Rooms inside a package and what each may not import: a package's own modules (its base, "")
# import none of its rooms unless listed; a room never imports the rooms named for it.
ROOMS_FORBIDDEN = {
    # launch/'s core imports no room, `unbroken agent`'s room never `unbroken run`'s, and the
    # recovery actions neither front end
    "launch": {"": ("run", "node", "recovery"), "node": ("run", "recovery"), "recovery": ("run", "node")},
    # the step's parts never reach up to the Manager, its factory or the wrappers
    "train": {"step": ("manager", "factory", "optimizer", "ddp", "managed_group", "interface", "checkpointing")},
    # diagnosis's base (verdicts, telemetry, robust statistics) imports neither room; rules never the master
    "diagnosis": {"": ("rules", "master"), "rules": ("master",)},
}


@pytest.mark.parametrize(
    ("package", "room"), [(p, r) for p, rooms in sorted(ROOMS_FORBIDDEN.items()) for r in sorted(rooms)]
)
def test_rooms_import_down(package: str, room: str) -> None:
    folder = PACKAGE / package / room if room else PACKAGE / package
    wrong = []
    for path in sorted(folder.glob("*.py")):
        for module in _imports(path):
            for other in ROOMS_FORBIDDEN[package][room]:
                target = f"unbroken.{package}.{other}"
                if module == target or module.startswith(target + "."):
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not wrong, wrong


# Packages still holding more than a dozen modules at one level, to be split, with their count:
# this only shrinks (issue 48 split every one).
NOT_YET_SPLIT: dict[str, int] = {}


def test_no_package_holds_more_than_a_dozen_modules_at_one_level() -> None:
    over = {}
    for folder in sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()):
        n = len([m for m in folder.glob("*.py") if m.name != "__init__.py"])
        rel = str(folder.relative_to(PACKAGE))
        if n > NOT_YET_SPLIT.get(rel, 12):
            over[rel] = n
    assert not over, f"split these into sub-packages of at most 12 modules: {over}"
    assert all(
        len([m for m in (PACKAGE / rel).glob("*.py") if m.name != "__init__.py"]) > 12 for rel in NOT_YET_SPLIT
    ), "split: take it off NOT_YET_SPLIT"


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


# A module's file name says what it is without its folder: two files of one name send a reader
# (and a search, a traceback, an editor tab) to the wrong one.
SHARED_NAMES = {"__init__.py", "__main__.py"}  # every package and `python -m` have one
# unbroken/torchft/ mirrors torchft's own modules so that `from torchft.process_group import ...`
# works unchanged under `unbroken run --torchft-compat` (unbroken/launch/run/torchft_compat.py): its
# copies of these names are the facade's, not a second module of the same role.
TORCHFT_MIRRORS = {"checkpointing.py", "data.py", "ddp.py", "manager.py", "process_group.py"}
# An example's entry point is `python -m unbroken.examples.<name>.train`, as torchtitan's is
# `torchtitan.train`: a path users are told to run (README.md, docs/llama.md), one per example.
EXAMPLE_ENTRY = "train.py"
# Names still held by two modules, to be renamed (issue 48); this set only shrinks.
NOT_YET_RENAMED: set[str] = set()


def test_no_two_modules_share_a_file_name() -> None:
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name in SHARED_NAMES or (rel.parts[0] == "torchft" and path.name in TORCHFT_MIRRORS):
            continue
        if rel.parts[0] == "examples" and len(rel.parts) == 3 and path.name == EXAMPLE_ENTRY:
            continue
        where.setdefault(path.name, []).append(str(rel))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not {n: p for n, p in shared.items() if n not in NOT_YET_RENAMED}, "rename one of them"
    assert not NOT_YET_RENAMED - set(shared), "renamed: take it off NOT_YET_RENAMED"


# --- the map in docs/architecture.md, checked against the code -----------------------------------
#
# The diagram is a Mermaid `graph` with one arrow per line: `a --> b & c` is a real import of `b`
# and `c` by `a`; a dotted arrow (`a -. "why" .-> b`) is one that points up a layer and must say
# why; `cli -. lazy .-> x` is a subcommand imported by name when invoked, not an import. The nodes
# in `subgraph base` may be imported by anyone without an arrow, and import only each other.
# A "unit" is a package under unbroken/ or a module directly in it.

ROOT = PACKAGE.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
NODE_ALIASES = {"api": "__init__"}  # Mermaid ids cannot read well as `__init__`
OUTSIDE_NODES = {"user"}  # the user's training script
NOT_MAPPED = {"__main__"}  # `python -m unbroken`: one line that calls cli.main
ARROW = re.compile(r"\s*(-->|-\.\s*(?:\"[^\"]*\"|[\w ]*?)\s*\.->)\s*")
NODE = re.compile(r"^(\w+)(?:\[\"[^\"]*\"\])?$")


def _units() -> set[str]:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return packages | {p.stem for p in PACKAGE.glob("*.py")} - NOT_MAPPED


def _unit_of(module: str, names: tuple[str, ...], units: set[str]) -> set[str]:
    """The units an import statement reaches: `from unbroken import config` is the module
    config.py, `from unbroken import Optimizer` the public API in __init__.py."""
    parts = module.split(".")
    if parts[0] != "unbroken":
        return set()
    if len(parts) > 1:
        return {parts[1]}
    return {n if n in units else "__init__" for n in names} or {"__init__"}


def _real_imports() -> dict[str, set[str]]:
    """unit -> the other units it imports, at the top or inside a function."""
    units = _units()
    out: dict[str, set[str]] = {u: set() for u in units}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        source = rel[0] if len(rel) > 1 else path.stem
        if source in NOT_MAPPED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out[source] |= _unit_of(node.module, tuple(a.name for a in node.names), units)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    out[source] |= _unit_of(alias.name, (), units)
        out[source].discard(source)
    return out


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


class Diagram:
    """The arrows and nodes of the first Mermaid block of docs/architecture.md."""

    def __init__(self, text: str) -> None:
        block = text.split("```mermaid\n", 1)[1].split("```", 1)[0]
        self.solid: set[tuple[str, str]] = set()
        self.dotted: dict[tuple[str, str], str] = {}
        self.nodes: set[str] = set()
        self.base: set[str] = set()
        in_base = False
        for raw in block.splitlines()[1:]:
            line = raw.strip()
            if line.startswith("subgraph base"):
                in_base = True
                continue
            if line == "end":
                in_base = False
                continue
            if not line or line.startswith("%%"):
                continue
            pieces = ARROW.split(line)
            assert len(pieces) in (1, 3), f"one arrow per line in the diagram: {line!r}"
            sources = self._names(pieces[0], line)
            self.nodes |= sources
            if in_base:
                self.base |= sources
            if len(pieces) == 1:
                continue
            targets = self._names(pieces[2], line)
            self.nodes |= targets
            if in_base:
                self.base |= targets
            label = pieces[1].removeprefix("-.").removesuffix(".->").strip().strip('"')
            for a in sources:
                for b in targets:
                    if pieces[1] == "-->":
                        self.solid.add((a, b))
                    else:
                        self.dotted[(a, b)] = label

    @staticmethod
    def _names(side: str, line: str) -> set[str]:
        out = set()
        for item in side.split("&"):
            match = NODE.match(item.strip())
            assert match, f"cannot read node {item.strip()!r} in diagram line {line!r}"
            out.add(NODE_ALIASES.get(match[1], match[1]))
        return out

    def arrows(self) -> set[tuple[str, str]]:
        return self.solid | set(self.dotted)


@pytest.fixture(scope="module")
def diagram() -> Diagram:
    return Diagram(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def real() -> dict[str, set[str]]:
    return _real_imports()


def test_every_unit_is_a_node_of_the_diagram(diagram: Diagram) -> None:
    assert sorted(_units() - diagram.nodes) == []
    strangers = diagram.nodes - _units() - OUTSIDE_NODES
    assert not strangers, f"the diagram names what is not under unbroken/: {sorted(strangers)}"


def test_every_real_import_is_drawn(diagram: Diagram, real: dict[str, set[str]]) -> None:
    missing = [
        f"{a} --> {b}"
        for a, targets in sorted(real.items())
        for b in sorted(targets - diagram.base)
        if (a, b) not in diagram.arrows()
    ]
    assert not missing, f"imported but not drawn in docs/architecture.md: {missing}"


def test_every_drawn_arrow_is_a_real_import(diagram: Diagram, real: dict[str, set[str]]) -> None:
    lazy = {(a, b) for (a, b), label in diagram.dotted.items() if label == "lazy"}
    invented = [
        f"{a} --> {b}"
        for a, b in sorted(diagram.arrows() - lazy)
        if a not in OUTSIDE_NODES and b not in real.get(a, set())
    ]
    assert not invented, f"drawn in docs/architecture.md but never imported: {invented}"


def test_the_lazy_arrows_are_the_subcommands(diagram: Diagram) -> None:
    from unbroken.cli import COMMANDS

    drawn = {b for (a, b), label in diagram.dotted.items() if label == "lazy" and a == "cli"}
    assert drawn == {target.split(".")[1] for target in COMMANDS.values()}


def test_the_base_imports_only_the_base(diagram: Diagram, real: dict[str, set[str]]) -> None:
    assert {"config", "wire"} <= diagram.base
    wrong = {unit: real[unit] - diagram.base for unit in diagram.base if real[unit] - diagram.base}
    assert not wrong, wrong


def test_solid_arrows_point_down(diagram: Diagram) -> None:
    """The solid arrows have no cycle, so they rank the layers; the few imports that point up
    are drawn dotted with the reason beside them."""
    assert all(label for label in diagram.dotted.values()), diagram.dotted
    below: dict[str, set[str]] = {}
    for a, b in diagram.solid:
        below.setdefault(a, set()).add(b)
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"a cycle of solid arrows: {' --> '.join((*path, node))}"
        if node not in done:
            for b in below.get(node, ()):
                visit(b, (*path, node))
            done.add(node)

    for node in sorted(below):
        visit(node, ())


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_the_diagram_keeps_forbidden_layers_out_of_reach(diagram: Diagram, package: str) -> None:
    """What the diagram lets a package reach, through any chain of arrows, is never a layer
    that FORBIDDEN keeps above it."""
    reach, todo = set(), [package]
    while todo:
        node = todo.pop()
        for a, b in diagram.arrows():
            if a == node and b not in reach:
                reach.add(b)
                todo.append(b)
    assert not reach & set(FORBIDDEN[package]), sorted(reach & set(FORBIDDEN[package]))


def _tour_rows() -> dict[str, str]:
    """First cell of each row of the package tour (`train/`, `examples/gpt/`, `entry.py`) -> row."""
    section = _section(ARCHITECTURE.read_text(), "## Layers, and where each concept lives")
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([\w/.]+)` \|", line)
        if match:
            rows[match[1]] = line
    return rows


def test_every_unit_has_a_row_in_the_tour() -> None:
    covered = {name.split("/")[0] if "/" in name else name.removesuffix(".py") for name in _tour_rows()}
    assert sorted(_units() - covered) == []


def test_every_module_the_architecture_names_exists() -> None:
    """A module named in a row is under the row's package; a path elsewhere in the page starts at
    a package (`train/manager.py`), at `unbroken/` or at `tests/`."""
    missing = []
    for first, row in _tour_rows().items():
        base = PACKAGE / first if first.endswith("/") else PACKAGE
        for name in re.findall(r"`([\w/]+\.py)`", row):
            if not (base / name).is_file() and not (PACKAGE / name).is_file():
                missing.append(f"{first}: {name}")
    for path in set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", ARCHITECTURE.read_text())):
        start = ROOT if path.startswith(("unbroken/", "tests/")) else PACKAGE
        if not (start / path).is_file():
            missing.append(path)
    assert not missing, f"docs/architecture.md names modules that do not exist: {sorted(missing)}"
