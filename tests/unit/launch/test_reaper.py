"""Ending a worker ends its whole session, and what the supervisor adopted is reaped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from unbroken.launch import reaper, workers

# The worker starts a child in a process group of its own (as a job-control shell or a daemonising
# library would): a kill of the worker's group alone misses it.
WORKER = (
    "import subprocess, sys, time; p = subprocess.Popen(['sleep', '600'], process_group=0); "
    "print(p.pid, flush=True); time.sleep(600)"
)


def state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


async def _scenario(log: Path) -> tuple[int, list[int]]:
    proc = await workers.start_worker((sys.executable, "-c", WORKER), dict(os.environ), log)
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    child = int(log.read_text().split()[0])
    try:
        await workers.kill_groups([proc])
        return child, reaper.session_members([proc.pid])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sessions and subreapers as Linux has them")
def test_ending_a_worker_ends_its_whole_session_and_reaps_what_was_adopted(tmp_path: Path) -> None:
    assert reaper.become_subreaper()
    try:
        child, left = asyncio.run(_scenario(tmp_path / "worker.log"))
    finally:
        reaper.become_subreaper(False)
    assert left == []
    assert state(child) is None  # dead and reaped: no zombie left under the supervisor


async def _unannounced(log: Path, guardian: reaper.Guardian) -> tuple[int, int]:
    proc = await workers.start_worker((sys.executable, "-c", WORKER), dict(os.environ), log, guardian)
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return proc.pid, int(log.read_text().split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sessions as Linux has them")
def test_a_worker_tells_the_guardian_its_session_before_it_starts_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor tells the guardian a worker's session once it is back from the fork; a
    supervisor killed before then must not leave the worker's children out of the guardian's reach."""
    guardian = reaper.Guardian()
    monkeypatch.setattr(guardian, "add", lambda sid: None)  # the supervisor's word never comes
    worker = child = 0
    try:
        worker, child = asyncio.run(_unannounced(tmp_path / "worker.log", guardian))
        assert state(child) not in (None, "Z")
        guardian.close()  # the pipe's end, as at the supervisor's death: the guardian kills what it knows
        deadline = time.monotonic() + 15
        while state(child) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state(child) in (None, "Z")  # the worker's child, in a process group of its own, is gone
    finally:
        for pid in (child, worker):
            with contextlib.suppress(ProcessLookupError):
                if pid:
                    os.kill(pid, signal.SIGKILL)
        guardian.close()


def test_a_worker_command_that_cannot_run_is_refused_before_any_fork(tmp_path: Path) -> None:
    guardian = reaper.Guardian()
    try:
        with pytest.raises(ValueError, match="no-such-trainer.*not found"):
            asyncio.run(workers.start_worker(("no-such-trainer",), dict(os.environ), tmp_path / "w.log", guardian))
        assert guardian.sessions == set()
    finally:
        guardian.close()
