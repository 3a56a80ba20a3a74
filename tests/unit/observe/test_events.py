"""Writing an event never takes down the caller: a full disk and a failing subscriber are counted."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from unbroken.observe import schema
from unbroken.observe.events import SOON_BATCH, EventLog, read_jsonl


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


def test_a_burst_emitted_soon_lands_whole_in_order_and_rotates(tmp_path: Path) -> None:
    """Written in batched appends: every event of a burst larger than a batch, in order, each
    handed to the subscribers, and the file still rotates past its size."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, "coordinator", max_bytes=64 << 10, backups=8)
    seen: list[int] = []
    log.subscribe(lambda e: seen.append(e.replica))  # type: ignore[attr-defined]
    n = 2 * SOON_BATCH + 7

    async def burst() -> None:
        for r in range(n):
            log.emit_soon(schema.build("replica_connected", replica=r, node=f"n{r}", step=3))
        await asyncio.sleep(0)

    asyncio.run(burst())
    log.close()
    rows = read_jsonl(path)
    assert [e["replica"] for e in rows] == list(range(n)) == seen
    assert all(e["source"] == "coordinator" for e in rows)
    assert (tmp_path / "events.jsonl.1").exists()  # rotated: the burst did not grow one file without bound


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_counts_every_event_of_a_lost_batch() -> None:
    log = EventLog("/dev/full", "test")

    async def burst() -> None:
        for r in range(5):
            log.emit_soon(schema.build("replica_connected", replica=r, node="n", step=0))
        await asyncio.sleep(0)

    asyncio.run(burst())
    log.close()
    assert log.write_failures == 5
