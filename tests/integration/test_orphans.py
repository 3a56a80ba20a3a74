"""``kill -9`` of a supervisor (``unbroken run``, ``unbroken agent``) leaves no process of its job.

The workers run behind a shell (``bash -c 'sleep 600; true'``), so the process doing the work is a
grandchild, out of reach of the parent-death signal that the shell itself gets. Every process of
the job carries a unique marker in its environment; the test finds them by it, and kills what it
finds by pid if the supervisor's guardian did not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.harness import python_env

pytestmark = pytest.mark.integration

WORKER = ["bash", "-c", "sleep 600; true"]  # "; true": bash cannot exec sleep, it forks it


def marked(marker: str) -> dict[int, str]:
    """Live processes whose environment holds ``marker``: pid -> command name."""
    needle = f"UNBROKEN_TEST_MARKER={marker}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] != "Z" and needle in Path(f"/proc/{entry}/environ").read_bytes():
                out[int(entry)] = stat.split("(", 1)[1].rsplit(")", 1)[0]
    return out


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def kill_9_leaves_nothing(supervisor: subprocess.Popen[bytes], marker: str, sleepers: int) -> None:
    try:
        wait_for(
            lambda: list(marked(marker).values()).count("sleep") == sleepers,
            60,
            f"{sleepers} workers' grandchildren to start",
        )
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        left: dict[int, str] = {}

        def gone() -> bool:
            nonlocal left
            left = marked(marker)
            return not left

        with contextlib.suppress(AssertionError):
            wait_for(gone, 15, "the job's processes to end")
        assert left == {}, f"processes of the job outlived kill -9 of its supervisor: {left}"
    finally:
        for pid in marked(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


def test_kill_9_of_unbroken_run_ends_the_workers_grandchildren(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--replicas", "2", "--run-dir", str(tmp_path / "run"), "--", *WORKER],
        env={**python_env(), "UNBROKEN_TEST_MARKER": marker},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kill_9_leaves_nothing(supervisor, marker, sleepers=2)


def test_kill_9_of_a_node_agent_ends_the_workers_grandchildren(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    coordinator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unbroken",
            "coordinator",
            "--replicas",
            "1",
            "--port",
            "0",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        env=python_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert coordinator.stderr is not None
        line = ""
        for _ in range(10):  # "lease term 1 held in ..." and the like come first
            line = coordinator.stderr.readline().decode()
            if line.startswith("coordinator listening on ") or not line:
                break
        assert line.startswith("coordinator listening on "), line
        address = line.split()[-1]
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "unbroken",
                "agent",
                "--coordinator",
                address,
                "--node",
                "n0",
                "--run-dir",
                str(tmp_path / "run"),
                "--",
                *WORKER,
            ],
            env={**python_env(), "UNBROKEN_TEST_MARKER": marker},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        kill_9_leaves_nothing(agent, marker, sleepers=1)
    finally:
        coordinator.kill()
        coordinator.wait()
