"""Writing an event never takes down the caller: a full disk and a failing subscriber are counted."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from unbroken.observe import schema
from unbroken.observe.events import EventLog, read_jsonl


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_loses_the_event_line_not_the_caller() -> None:
    seen: list[str] = []
    log = EventLog("/dev/full", "test")  # every write fails with ENOSPC, as on a full disk
    log.subscribe(lambda e: seen.append(e.kind))
    log.emit("replica_evicted", replica=2)
    log.emit("quorum", epoch=3, step=0, members=[0])
    log.close()
    assert log.write_failures == 2
    assert seen == ["replica_evicted", "quorum"]  # the subscribers (the state store) still hear them


def test_a_failing_subscriber_does_not_stop_the_others_or_the_caller(tmp_path: Path) -> None:
    seen: list[str] = []

    def broken(event: object) -> None:
        raise RuntimeError("database or disk is full")

    log = EventLog(tmp_path / "events.jsonl", "test")
    log.subscribe(broken)
    log.subscribe(lambda e: seen.append(e.kind))
    log.emit("replica_silent", replicas=[1], after_s=0.5)
    log.close()
    assert log.subscriber_failures == 1 and seen == ["replica_silent"]
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["replica_silent"]


def test_an_event_emitted_soon_is_written_after_the_turn_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, "test")

    async def turn() -> list[str]:
        log.emit_soon(schema.build("replica_connected", replica=0, node="n0", step=3))
        log.emit_soon(schema.build("replica_connected", replica=1, node="n1", step=3))
        written_in_the_turn = [e["kind"] for e in read_jsonl(path)]
        await asyncio.sleep(0)
        log.emit_soon(schema.build("replica_connected", replica=2, node="n2", step=3))
        log.emit("epoch_resumed", epoch=4, step=3, members=[0, 1, 2], window_s=5.0)  # writes what waits first
        return written_in_the_turn

    assert asyncio.run(turn()) == []  # nothing was written while the turn ran
    log.close()
    rows = read_jsonl(path)
    assert [(e["kind"], e.get("replica")) for e in rows] == [
        ("replica_connected", 0),
        ("replica_connected", 1),
        ("replica_connected", 2),
        ("epoch_resumed", None),
    ]


def test_an_event_emitted_soon_outside_an_event_loop_is_written_at_once(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", "test")
    log.emit_soon(schema.build("replica_connected", replica=0, node="n0", step=3))
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["replica_connected"]
    log.close()
