"""A replica's death reaches the survivors as their next epoch, pushed with the abort.

A real ``unbroken coordinator`` process and real replica clients: when one replica's connection
closes, each survivor is told to abort the broken epoch and, with it, the epoch it would have
been answered had it asked again; its next request is answered at once, and the steps after go
on on the fast path of that epoch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.harness import job_secret
from tests.integration.test_coordinator_faults import start_coordinator
from unbroken.control.client import CoordinatorClient

pytestmark = pytest.mark.integration


def test_survivors_get_the_next_epoch_with_the_abort_and_need_not_ask(tmp_path: Path) -> None:
    coordinator, address = start_coordinator(tmp_path, replicas=3)
    secret = job_secret()
    aborted: dict[int, list[int]] = {0: [], 1: []}
    told = threading.Barrier(3)

    def on_abort(replica: int) -> Callable[[int], None]:
        def abort(epoch: int) -> None:
            aborted[replica].append(epoch)
            told.wait(30)

        return abort

    clients = [
        CoordinatorClient(
            address,
            secret,
            {"replica": r, "rank": 0, "world_size": 1, "transfer_addr": ""},
            on_abort=on_abort(r) if r < 2 else None,
            heartbeat_s=0.1,
        )
        for r in range(3)
    ]
    try:
        for c in clients:
            c.wait_connected(30)
        first = [f.result(timeout=30)["decision"] for f in [c.request_quorum(0) for c in clients]]
        epoch = first[0]["epoch"]
        assert first[0]["members"] == [0, 1, 2]
        # Replicas 0 and 1 start step 1 in the same epoch; replica 2 dies mid-step.
        fast = [f.result(timeout=30)["decision"] for f in [c.request_quorum(1) for c in clients[:2]]]
        assert [d["epoch"] for d in fast] == [epoch, epoch]
        clients[2].close(finished=False)
        told.wait(30)  # each survivor was told to abort the broken epoch
        assert aborted == {0: [epoch], 1: [epoch]}
        t0 = time.monotonic()
        redo = [c.request_quorum(1, failed_epoch=epoch) for c in clients[:2]]
        assert all(f.done() for f in redo), "the pushed epoch is the answer: no round trip"
        pushed = [f.result(timeout=0)["decision"] for f in redo]
        assert time.monotonic() - t0 < 1.0
        assert [(d["epoch"], d["step"], d["members"], d["behind"]) for d in pushed] == [(epoch + 1, 1, [0, 1], [])] * 2
        # The next step is answered by the coordinator, on the fast path of the pushed epoch.
        nxt = [f.result(timeout=30)["decision"] for f in [c.request_quorum(2) for c in clients[:2]]]
        assert [(d["epoch"], d["step"], d["members"]) for d in nxt] == [(epoch + 1, 2, [0, 1])] * 2
    finally:
        for c in clients:
            c.close(finished=False)
        coordinator.kill()
        coordinator.wait()
