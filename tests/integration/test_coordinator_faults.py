"""The coordinator keeps its job alive when its own state directory fails under it.

A real ``unbroken coordinator`` process whose file writes start failing (``RLIMIT_FSIZE`` set
from outside: every write past the limit fails with EFBIG, as on a full disk) must still evict a
replica that went silent and answer the survivors.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.harness import job_secret, python_env
from unbroken.control import protocol
from unbroken.control.client import CoordinatorClient

pytestmark = pytest.mark.integration


def start_coordinator(tmp_path: Path, replicas: int) -> tuple[subprocess.Popen[bytes], str]:
    log = tmp_path / "coordinator.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "unbroken",
                "coordinator",
                "--replicas",
                str(replicas),
                "--min-replicas",
                "2",
                "--port",
                "0",
                "--state-dir",
                str(tmp_path / "state"),
                "--heartbeat-timeout",
                "3",
                "--startup-window",
                "60",
            ],
            env=python_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("coordinator listening on "):
                return proc, line.rsplit(" ", 1)[1]
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"the coordinator did not start: {log.read_text()}")


def test_a_silent_replica_is_evicted_and_survivors_answered_while_event_writes_fail(tmp_path: Path) -> None:
    coordinator, address = start_coordinator(tmp_path, replicas=3)
    host, port = address.rsplit(":", 1)
    secret = job_secret()
    clients = [
        CoordinatorClient(
            address, secret, {"replica": r, "rank": 0, "world_size": 1, "transfer_addr": ""}, heartbeat_s=0.1
        )
        for r in (0, 1)
    ]
    silent, session = protocol.connect(host, int(port), secret, timeout=30)
    silent_lock = threading.Lock()  # one sealed line at a time: the MACs count in wire order
    stop_beating = threading.Event()

    def send(msg: dict[str, object]) -> None:
        with silent_lock:
            silent.sendall(protocol.encode(msg, session))

    def beat() -> None:
        while not stop_beating.wait(0.1):
            send({"op": "heartbeat", "step": 0})

    beating = threading.Thread(target=beat, daemon=True)
    try:
        for c in clients:
            c.wait_connected(30)
        send({"op": "hello", "replica": 2, "rank": 0, "world_size": 1})
        beating.start()
        send({"op": "quorum", "id": 1, "step": 0})
        first = [f.result(timeout=30)["decision"] for f in [c.request_quorum(0) for c in clients]]
        assert first[0]["members"] == [0, 1, 2]
        stop_beating.set()
        beating.join()

        events = tmp_path / "state" / "events.jsonl"
        size = events.stat().st_size
        # From now on every write of the coordinator to a file fails, as on a full disk.
        resource.prlimit(coordinator.pid, resource.RLIMIT_FSIZE, (1, 1))
        # Replica 2 hangs (no heartbeat, connection open); the others' exchange with it fails.
        answers = [c.request_quorum(1, failed_epoch=first[0]["epoch"]) for c in clients]
        decisions = [a.result(timeout=20)["decision"] for a in answers]
        assert [d["members"] for d in decisions] == [[0, 1], [0, 1]]
        assert decisions[0]["epoch"] > first[0]["epoch"]

        # The hung replica is evicted: the coordinator closes its connection.
        silent.settimeout(20)
        while silent.recv(1 << 16):
            pass
        assert events.stat().st_size == size, "event writes were meant to fail"
        # And the coordinator still serves.
        status = protocol.request(host, int(port), secret, {"op": "status"}, timeout=10)
        assert sorted(status["replicas"]) == ["0", "1"]
        assert all(v["alive"] for v in status["replicas"].values())
    finally:
        stop_beating.set()
        silent.close()
        for c in clients:
            c.close(finished=False)
        coordinator.kill()
        coordinator.wait()
