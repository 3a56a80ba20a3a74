"""SIGTERM to a node agent (Slurm preemption, ``scancel``) reaches its workers, which get the grace
period to flush a checkpoint; before, the agent killed them at once (SIGKILL) and exited 130."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import Processes
from unbroken.launch.workers import free_port
from unbroken.observe.events import read_events

pytestmark = pytest.mark.integration

# A worker that, like unbroken.train.preemption, flushes on SIGTERM and exits 75.
WORKER = """
import os, signal, sys, time
from pathlib import Path
out = Path(os.environ["UNBROKEN_RUN_DIR"]) / f"flushed-r{os.environ['UNBROKEN_REPLICA_ID']}"
def flush(signum, frame):
    time.sleep(0.5)  # a checkpoint reaching the disk
    out.write_text("flushed")
    sys.exit(75)
signal.signal(signal.SIGTERM, flush)
Path(os.environ["UNBROKEN_RUN_DIR"], "started").write_text(os.environ["UNBROKEN_SECRET_FILE"])
while True:
    time.sleep(0.05)
"""


def test_sigterm_to_an_agent_lets_its_workers_flush(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()
    with Processes(tmp_path) as ps:
        ps.coordinator(port, replicas=1, min_replicas=1, state_dir=tmp_path / "state")
        agent = ps.start(
            [
                sys.executable,
                "-m",
                "unbroken",
                "agent",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--node",
                "n0",
                "--run-dir",
                str(run_dir),
                "--term-grace-s",
                "10",
                "--",
                sys.executable,
                "-c",
                WORKER,
            ],
            "agent",
        )
        deadline = time.monotonic() + 60
        while not (run_dir / "started").exists():
            assert time.monotonic() < deadline and agent.poll() is None, "the agent started no worker"
            time.sleep(0.05)
        assert Path((run_dir / "started").read_text()).exists()  # the worker was handed the secret file
        os.kill(agent.pid, signal.SIGTERM)
        assert agent.wait(20) == 143
    assert (run_dir / "flushed-r0").read_text() == "flushed", "the worker was killed before it could flush"
    done = [e for e in read_events(run_dir / "events-n0.jsonl") if e["kind"] == "agent_terminated"]
    assert done and done[0]["killed"] == 0 and done[0]["exit_codes"] == {"0": [75]}
