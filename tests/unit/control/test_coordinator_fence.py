"""A coordinator whose lease is not valid answers nothing, and drops nobody (no two active
coordinators, and no eviction for a stall of its lease store).

A real coordinator on loopback with its fence switched off, as when its lease store stalls for a
moment or a hung one wakes up after its lease lapsed: a request waits unanswered on its kept
connection, a closed connection evicts no one (which would answer the others), the tick forms no
epoch. Once the fence is valid again, the waiting request is answered, the closed connection's
replica is evicted, and the silence nobody could be heard in is held against no one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.live_coordinator import member, next_op
from unbroken.control import protocol
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()


async def nothing_within(link: protocol.Link, timeout: float) -> bool:
    """Whether ``link`` stays open and silent for ``timeout``."""
    try:
        await asyncio.wait_for(link.readline(), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return True
    return False


def ask(step: int = 0) -> dict[str, object]:
    return protocol.QuorumAsk(id=1, step=step, step_time=None, failed_epoch=None).to_msg()


def test_a_fenced_off_coordinator_answers_nothing_and_keeps_every_connection(tmp_path: Path) -> None:
    valid = [True]

    async def main() -> None:
        settings = CoordinatorSettings(total_replicas=2, min_replicas=1, state_dir=tmp_path, startup_window_s=0.1)
        c = Coordinator(settings, SECRET, fence=lambda: valid[0])
        await c.start()
        try:
            a, b = await member(c, SECRET, 0), await member(c, SECRET, 1)
            valid[0] = False  # the lease lapsed
            a.send(ask())
            b.send(ask())
            assert await nothing_within(a, 1.0) and await nothing_within(b, 0.1)
            await asyncio.sleep(5 * Coordinator.TICK_S)
            assert c.quorum.current is None and c.fenced_off >= 4  # ticks left undone
            assert sorted(c.replicas) == [0, 1]  # nobody evicted: that would answer the rest
            valid[0] = True  # the store answers again: the waiting requests are answered
            got = await next_op(a, "quorum", 5.0)
            assert got["decision"]["epoch"] == 1 and got["decision"]["member_runs"] == [[0, 1]]
            assert c.connections.fenced_waits >= 2
        finally:
            await c.stop()

    asyncio.run(main())


def test_a_connection_closed_in_a_lapse_evicts_its_replica_once_the_lease_is_valid(tmp_path: Path) -> None:
    valid = [True]

    async def main() -> None:
        settings = CoordinatorSettings(total_replicas=2, min_replicas=1, state_dir=tmp_path, startup_window_s=0.1)
        c = Coordinator(settings, SECRET, fence=lambda: valid[0])
        await c.start()
        try:
            a = await member(c, SECRET, 0)
            await member(c, SECRET, 1)
            valid[0] = False
            a.writer.close()
            await asyncio.sleep(0.5)
            assert 0 in c.replicas  # not while the lease is lapsed
            valid[0] = True
            for _ in range(100):
                if 0 not in c.replicas:
                    break
                await asyncio.sleep(0.05)
            assert 0 not in c.replicas
        finally:
            await c.stop()

    asyncio.run(main())


def test_a_lapse_longer_than_the_heartbeat_timeout_evicts_no_one(tmp_path: Path) -> None:
    valid = [True]

    async def main() -> None:
        settings = CoordinatorSettings(
            total_replicas=2, min_replicas=1, state_dir=tmp_path, startup_window_s=0.1, heartbeat_timeout_s=0.6
        )
        c = Coordinator(settings, SECRET, fence=lambda: valid[0])
        await c.start()
        try:
            a, b = await member(c, SECRET, 0), await member(c, SECRET, 1)
            valid[0] = False
            await asyncio.sleep(1.0)  # nobody could be heard: a store stall, not the replicas' silence
            valid[0] = True
            for link in (a, b):  # they speak once heard again
                link.send(protocol.Heartbeat(step=0, compute_s=None).to_msg())
            await asyncio.sleep(0.3)
            assert sorted(c.replicas) == [0, 1]
        finally:
            await c.stop()

    asyncio.run(main())
