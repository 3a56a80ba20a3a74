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
