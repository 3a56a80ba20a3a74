"""The coordinator's durable state: safe on a shared filesystem, one owner, bounded, epochs never reused."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import python_env
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.quorum.rules import QuorumRequest
from unbroken.control.state.state_store import StateStore
from unbroken.wire.auth import JobSecret


def coordinator(state_dir: Path, **kw: object) -> Coordinator:
    return Coordinator(
        CoordinatorSettings(total_replicas=1, state_dir=state_dir, **kw),  # type: ignore[arg-type]
        JobSecret.generate(),
    )


def new_epoch_request(c: Coordinator) -> QuorumRequest:
    """A request that forms an epoch: the one a restarted coordinator resumed (if any) failed."""
    cur = c.quorum.current
    return QuorumRequest(replica=0, step=0, failed_epoch=cur.epoch if cur is not None else None)


def test_the_database_uses_a_rollback_journal_unless_wal_is_asked_for(tmp_path: Path) -> None:
    # WAL's shared-memory index is unsafe on a network filesystem, where the README puts it.
    c = coordinator(tmp_path / "a")
    asyncio.run(c.stop())
    with sqlite3.connect(tmp_path / "a" / "coordinator.sqlite") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    store = StateStore(tmp_path / "b", journal_mode="wal")
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: a commit is on disk
    store.close()
    with sqlite3.connect(tmp_path / "b" / "coordinator.sqlite") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_second_coordinator_on_the_same_state_directory_fails_at_once(tmp_path: Path) -> None:
    first = coordinator(tmp_path)
    with pytest.raises(ValueError, match="another coordinator .* is running on the state directory"):
        coordinator(tmp_path)
    asyncio.run(first.stop())
    asyncio.run(coordinator(tmp_path).stop())  # free again once the first one is gone


def test_an_epoch_is_never_issued_twice_across_restarts(tmp_path: Path) -> None:
    issued = []
    for _ in range(3):
        c = coordinator(tmp_path)
        _, formed = c.quorum.request(new_epoch_request(c), time.monotonic())
        c.requests.deliver(formed)
        issued.append(formed[0].epoch)
        asyncio.run(c.stop())
    assert issued == sorted(set(issued)), issued


CRASH_AFTER_ISSUING = """
import os, sys, time
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.quorum.rules import QuorumRequest
from unbroken.wire.auth import JobSecret
c = Coordinator(CoordinatorSettings(total_replicas=1, state_dir=sys.argv[1]), JobSecret.generate())
_, formed = c.quorum.request(QuorumRequest(replica=0, step=0), time.monotonic())
print(formed[0].epoch, flush=True)  # handed out...
os._exit(9)  # ...and the coordinator dies before its history row is written
"""


def test_an_epoch_handed_out_just_before_a_crash_is_not_reused(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CRASH_AFTER_ISSUING, str(tmp_path)], env=python_env(), capture_output=True, timeout=120
    )
    assert out.returncode == 9, out.stderr.decode()
    lost = int(out.stdout)
    c = coordinator(tmp_path)  # the lock died with the crashed process
    _, formed = c.quorum.request(new_epoch_request(c), time.monotonic())
    asyncio.run(c.stop())
    assert formed[0].epoch > lost


def test_no_epoch_is_formed_past_what_is_reserved_on_disk(tmp_path: Path) -> None:
    c = coordinator(tmp_path / "c")
    c.quorum.epoch_limit = c.quorum.epoch  # the reservation could not be written (disk full)
    answer, formed = c.quorum.request(QuorumRequest(replica=0, step=0), time.monotonic())
    assert answer is None and formed == []  # the replica waits rather than get an unsafe epoch
    c.quorum.epoch_limit = c.store.persist(c.quorum.epoch)  # writable again: the writer reserves
    assert [d.epoch for d in c.quorum.evaluate(time.monotonic())] == [c.store.epoch_floor + 1]
    asyncio.run(c.stop())

    store = StateStore(tmp_path, epoch_block=4)
    assert store.epoch_ceiling == 4
    assert store.reserve_epochs(1) == 4  # half a block still ahead: no write
    assert store.reserve_epochs(3) == 7
    store.close()
    reopened = StateStore(tmp_path, epoch_block=4)
    assert reopened.epoch_floor == 7 and reopened.epoch_ceiling == 11
    reopened.close()


def test_events_are_bounded_to_the_newest(tmp_path: Path) -> None:
    store = StateStore(tmp_path, keep_events=50)
    for i in range(500):
        store.record_event({"t": float(i), "kind": "tick", "i": i})
        if i % 7 == 0:
            store.flush()
    store.close()
    reopened = StateStore(tmp_path, keep_events=50)
    kept = [e["i"] for e in reopened.events()]
    reopened.close()
    assert 50 <= len(kept) <= 55 and kept == sorted(kept) and kept[-1] == 499


def test_a_coordinator_that_fails_to_start_frees_its_state_directory(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        c = coordinator(tmp_path, port=busy.getsockname()[1])
        with pytest.raises(OSError, match="cannot listen"):
            asyncio.run(c.start())
    asyncio.run(coordinator(tmp_path).stop())  # a second try on the same directory may start


def test_the_epoch_history_stays_bounded_over_many_epochs(tmp_path: Path) -> None:
    members = list(range(5000))  # 28 KB a row: unpruned, the file grew by that every epoch
    store = StateStore(tmp_path, keep_epochs=20)
    try:
        for epoch in range(1, 301):
            store.record_epoch(epoch, epoch * 10, members, [7] if epoch % 2 else [])
            assert store.flush()
            if epoch == 100:
                size_at_100 = store.path.stat().st_size
        with sqlite3.connect(store.path) as db:
            kept = [r[0] for r in db.execute("SELECT epoch FROM epochs ORDER BY epoch")]
        assert kept == list(range(281, 301))  # the newest
        assert store.last_epoch() == (300, 3000, tuple(members), ())
        assert store.path.stat().st_size <= size_at_100 + (1 << 20)  # freed pages are reused
    finally:
        store.close()
    again = StateStore(tmp_path, keep_epochs=20)  # a restart continues the last, issues above
    try:
        assert again.last_epoch() is not None and again.epoch_floor >= 300
    finally:
        again.close()


def test_an_older_runs_long_epoch_history_is_pruned_at_the_first_write(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "coordinator.sqlite") as db:
        db.execute("CREATE TABLE epochs (epoch INTEGER PRIMARY KEY, step INTEGER, members TEXT, behind TEXT, t REAL)")
        db.executemany("INSERT INTO epochs VALUES (?, 0, '[0]', '[]', 0)", [(e,) for e in range(1, 1001)])
    store = StateStore(tmp_path)
    try:
        assert store.epoch_floor >= 1000
        store.flush()
        with sqlite3.connect(store.path) as db:
            assert db.execute("SELECT COUNT(*), MIN(epoch) FROM epochs").fetchone() == (100, 901)
    finally:
        store.close()
