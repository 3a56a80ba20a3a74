"""events.jsonl rotates at a size with a bounded number of old files, and its readers see it all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.observe.events import EventLog, read_jsonl, rotated_files
from unbroken.observe.live import JobView, JsonlTail


def emit(log: EventLog, n: int, first: int = 0) -> None:
    for i in range(first, first + n):
        log.emit("quorum", epoch=i, step=i, members=[0, 1])


def test_the_log_rotates_at_its_size_and_keeps_a_bounded_number_of_old_files(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, "coordinator", max_bytes=2000, backups=3)
    emit(log, 500)
    log.close()
    old = rotated_files(path)
    assert [p.name for p in old] == ["events.jsonl.3", "events.jsonl.2", "events.jsonl.1"]
    files = [*old, path]
    # Each file passes the limit by at most one line; 500 lines of ~100 bytes would be ~50 kB.
    assert all(p.stat().st_size < 2000 + 200 for p in files)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files)
    epochs = [e["epoch"] for e in read_jsonl(path)]
    # What is kept is the newest history, in order, with nothing lost inside it.
    assert epochs == list(range(epochs[0], 500)) and epochs[0] > 0


def test_writers_in_two_processes_share_one_rotating_log_without_losing_a_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    code = (
        "import sys; from unbroken.observe.events import EventLog\n"
        "log = EventLog(sys.argv[1], sys.argv[2], max_bytes=4000, backups=1000)\n"
        "for i in range(400): log.emit('quorum', epoch=i, step=0, members=[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(path), src], env=env) for src in ("launcher", "coordinator")
    ]
    try:
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    events = list(read_jsonl(path))
    for src in ("launcher", "coordinator"):
        assert sorted(e["epoch"] for e in events if e["source"] == src) == list(range(400))
    assert len(rotated_files(path)) > 5


def test_a_tail_reads_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, "coordinator", max_bytes=1500, backups=2)
    tail = JsonlTail(path)
    emit(log, 5)
    seen = [r["epoch"] for r in tail.read()]
    emit(log, 15, first=5)  # rotates in between: the tail finishes its file, then reads the newer ones
    seen += [r["epoch"] for r in tail.read()]
    log.close()
    assert rotated_files(path) and seen == list(range(20))


def test_the_dashboard_view_counts_events_of_rotated_files(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", "coordinator", max_bytes=1500, backups=10)
    view = JobView(tmp_path)
    emit(log, 10)
    view.refresh()
    emit(log, 30, first=10)
    view.refresh()
    log.close()
    assert len(rotated_files(tmp_path / "events.jsonl")) >= 2
    assert view.events_read == 40 and view.job["epoch"] == 39


def test_bad_limits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        EventLog(tmp_path / "e.jsonl", "x", max_bytes=0)
