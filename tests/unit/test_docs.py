"""The user docs agree with the code they describe, so that they cannot drift from it.

`unbroken bench` scenarios are listed once, in :data:`unbroken.cli.BENCHMARKS`; a doc names a
scenario only if it exists, lists them all or none, and the user guides hold the current figures
while the measurement logs (commit hashes, before/after runs) live in dated pages under
docs/benchmarks/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import unbroken
from unbroken.cli import BENCHMARKS, main

ROOT = Path(unbroken.__file__).parent.parent
USER_DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
BENCHMARK_INDEX = ROOT / "docs" / "benchmarks" / "README.md"
BENCHMARK_PAGES = sorted(p for p in (ROOT / "docs" / "benchmarks").glob("*.md") if p != BENCHMARK_INDEX)
NAMED = re.compile(r"unbroken bench ([a-z][a-z-]*(?:\|[a-z][a-z-]*)*)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_bench_help_lists_exactly_the_registry() -> None:
    """A scenario added to the `bench` group but not to BENCHMARKS would be missing from the
    docs' checks and from tests/unit/test_cli.py."""
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    listed = set(re.findall(r"^  ([a-z][a-z-]*)\s", result.output.split("Commands:")[1], re.M))
    assert listed == set(BENCHMARKS)


@pytest.mark.parametrize("doc", USER_DOCS, ids=_rel)
def test_every_bench_a_doc_names_exists(doc: Path) -> None:
    """`unbroken bench NAME` names a registered scenario; `unbroken bench a|b|c` lists them all
    (better: name none and point to `unbroken bench --help`)."""
    wrong = []
    for match in NAMED.finditer(doc.read_text()):
        names = match[1].split("|")
        if len(names) > 1 and set(names) != set(BENCHMARKS):
            wrong.append(f"{match[0]!r} lists {sorted(names)}, the scenarios are {sorted(BENCHMARKS)}")
        wrong += [f"{match[0]!r}: no scenario {name!r}" for name in names if name not in BENCHMARKS]
    assert not wrong, wrong


def test_every_scenario_is_documented() -> None:
    named = {name for doc in USER_DOCS for m in NAMED.finditer(doc.read_text()) for name in m[1].split("|")}
    assert sorted(set(BENCHMARKS) - named) == []


# A user guide states the current figure and links its dated page; a commit hash or a
# before/after table in it is a measurement log that belongs in docs/benchmarks/.
HASH = re.compile(r"(?<![\w/#.-])[0-9a-f]{7,40}(?![\w/.-])")


def _looks_like_hash(token: str) -> bool:
    return bool(re.search(r"[a-f]", token)) and bool(re.search(r"[0-9]", token))


def _before_after_rows(text: str) -> list[str]:
    """Table rows of a before/after comparison: a cell that is just "before" or "after", or one
    cell starting with each."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip().strip("*").lower() for cell in line.strip("|").split("|")]
        starts = {word for cell in cells for word in ("before", "after") if cell.startswith(word)}
        if {"before", "after"} & set(cells) or starts == {"before", "after"}:
            rows.append(line)
    return rows


@pytest.mark.parametrize("doc", USER_DOCS, ids=_rel)
def test_user_guides_hold_no_measurement_log(doc: Path) -> None:
    text = doc.read_text()
    hashes = sorted({m[0] for m in HASH.finditer(text) if _looks_like_hash(m[0])})
    assert not hashes, f"{_rel(doc)} names commits {hashes}: move the log to docs/benchmarks/"
    tables = _before_after_rows(text)
    assert not tables, f"{_rel(doc)} has before/after tables {tables}: move them to docs/benchmarks/"


@pytest.mark.parametrize("page", BENCHMARK_PAGES, ids=_rel)
def test_a_benchmark_page_is_dated_and_says_how(page: Path) -> None:
    """The form of docs/benchmarks/: YYYY-MM-DD-topic.md, the command that reproduces it, and
    the machine it ran on."""
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", page.name), page.name
    text = page.read_text()
    assert re.search(r"```|`(unbroken|python|pytest|make) ", text), f"{page.name}: no command"
    assert re.search(r"\b(machine|cores?|CPU|GPU|H100|H200)\b", text), f"{page.name}: no machine"


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_between_docs_resolve() -> None:
    """A relative link in a doc points to a file that exists, and to a heading of it when it names
    one (a moved section leaves no dead link)."""
    dead = []
    for doc in [*USER_DOCS, *BENCHMARK_PAGES, BENCHMARK_INDEX]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target) if target else doc
            if not path.exists():
                dead.append(f"{_rel(doc)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                dead.append(f"{_rel(doc)} -> {target}#{anchor}")
    assert not dead, dead


def test_the_benchmark_index_lists_every_page() -> None:
    """docs/benchmarks/README.md gives each topic's current figure and page: a new page is listed
    there, as the current figure of its topic or as one it superseded."""
    linked = set(re.findall(r"\]\(([^)#\s]+)", BENCHMARK_INDEX.read_text()))
    missing = [page.name for page in BENCHMARK_PAGES if page.name not in linked]
    assert not missing, f"docs/benchmarks/README.md does not list {missing}"
