"""Writing an event never takes down the caller: a full disk and a failing subscriber are counted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
