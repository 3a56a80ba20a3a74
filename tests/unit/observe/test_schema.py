"""The event schema: every kind is a dataclass, written as one JSON line with a version, and
read back into the same dataclass; a writer with a wrong field fails where it writes."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from unbroken.observe import schema
from unbroken.observe.events import EventLog, read_jsonl, read_typed


def test_an_event_round_trips_through_its_json_line_with_the_schema_version(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", "coordinator")
    seen: list[schema.Event] = []
    log.subscribe(seen.append)
    log.emit(schema.ReplicaEvicted(replica=2, cause=schema.EvictCause.NO_HEARTBEAT, reason="silent", member=True))
    log.emit("verdict", culprit={"replica": 1}, **{"class": "straggler"}, confidence=0.9)
    log.close()
    lines = list(read_jsonl(tmp_path / "events.jsonl"))
    assert [line["schema"] for line in lines] == [schema.SCHEMA_VERSION] * 2
    assert lines[0]["cause"] == "no_heartbeat" and lines[0]["source"] == "coordinator"
    assert lines[1]["class"] == "straggler"  # the JSON name, as readers of the log have always used
    assert "detect_s" not in lines[1]  # an optional field not given is absent, as before the schema
    typed = list(read_typed(tmp_path / "events.jsonl"))
    assert typed == seen
    assert isinstance(typed[0], schema.ReplicaEvicted) and typed[0].cause is schema.EvictCause.NO_HEARTBEAT
    assert isinstance(typed[1], schema.Verdict) and typed[1].verdict_class == "straggler"


def test_a_field_the_kind_does_not_have_fails_at_the_writer(tmp_path: Path) -> None:
    log = EventLog(None, "launcher")
    with pytest.raises(TypeError):
        log.emit("replica_evicted", replica=1, reson="typo")
    with pytest.raises(TypeError):
        log.emit("quorum", epoch=1)  # step and members missing
    with pytest.raises(KeyError, match="no event kind"):
        log.emit("made_up_kind")


def test_a_version_0_line_reads_with_an_unknown_cause_and_unknown_kinds_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    old = {"t": 1.0, "source": "coordinator", "kind": "replica_evicted", "replica": 0, "reason": "no heartbeat for 2s"}
    path.write_text(
        "\n".join(
            json.dumps(x)
            for x in (old, {"t": 2.0, "kind": "from_the_future", "x": 1}, {"t": 3.0, "kind": "quorum", "epoch": 1})
        )
        + "\n"
    )
    (event,) = read_typed(path)  # the future kind and the quorum without its fields are skipped
    assert isinstance(event, schema.ReplicaEvicted) and event.cause is schema.EvictCause.UNKNOWN


def test_every_event_the_package_writes_by_name_fits_its_class() -> None:
    """Every ``emit("kind", field=...)`` in the package names a kind of the schema, only fields
    that kind has, and all the fields it needs (unless some come from a ``**mapping``): a
    mismatch would raise in the writer (a coordinator, an agent) the first time it runs."""
    root = Path(schema.__file__).parents[1]
    checked, wrong = 0, []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "emit"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            cls = schema.KINDS.get(node.args[0].value)
            if cls is None:
                wrong.append(f"{where}: no kind {node.args[0].value!r}")
                continue
            fields = {f.name: f for f in dataclasses.fields(cls)}
            given = {schema._RENAMED.get(k.arg, k.arg) for k in node.keywords if k.arg is not None}
            wrong += [f"{where}: {cls.__name__} has no field {name!r}" for name in sorted(given - set(fields))]
            if all(k.arg is not None for k in node.keywords):
                needed = {
                    n
                    for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                }
                wrong += [f"{where}: {cls.__name__} needs {name!r}" for name in sorted(needed - given)]
            checked += 1
    assert checked > 20 and not wrong, wrong
