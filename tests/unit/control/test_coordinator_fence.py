"""A coordinator whose lease is not valid answers nothing (no two active coordinators).

A real coordinator on loopback with its fence switched off, as when a hung one wakes up after
its lease lapsed: a request closes its connection unanswered, a closed connection evicts no one
(which would answer the others), the tick forms no epoch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.live_coordinator import member
from unbroken.control import protocol
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()


async def lines_until_closed(link: protocol.Link, timeout: float) -> list[dict[str, object]] | None:
    """What the coordinator sends on ``link`` until it closes it; None if still open at ``timeout``."""
    got: list[dict[str, object]] = []

    async def drain() -> None:
        while (line := await link.readline()) is not None:
            got.append(link.decode(line))

    try:
        await asyncio.wait_for(drain(), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return None
    except ConnectionError:
        pass
    return got


def test_a_fenced_off_coordinator_answers_nothing(tmp_path: Path) -> None:
    valid = [True]

    async def main() -> None:
        settings = CoordinatorSettings(total_replicas=2, min_replicas=1, state_dir=tmp_path, startup_window_s=0.1)
        c = Coordinator(settings, SECRET, fence=lambda: valid[0])
        await c.start()
        try:
            a, b = await member(c, SECRET, 0), await member(c, SECRET, 1)
            valid[0] = False  # the lease lapsed
            a.send(protocol.QuorumAsk(id=1, step=0, step_time=None, failed_epoch=None).to_msg())
            assert await lines_until_closed(a, 5.0) == []  # closed, without a word
            b.send(protocol.QuorumAsk(id=1, step=0, step_time=None, failed_epoch=None).to_msg())
            assert await lines_until_closed(b, 5.0) == []
            await asyncio.sleep(5 * Coordinator.TICK_S)
            assert c.quorum.current is None and c.fenced_off >= 4  # two messages, ticks
            assert sorted(c.replicas) == [0, 1]  # nobody evicted: that would answer the rest
            fresh = await asyncio.wait_for(_connect(c), 5.0)
            fresh.send(protocol.StatusRequest().to_msg())
            assert await lines_until_closed(fresh, 5.0) == []
        finally:
            await c.stop()

    asyncio.run(main())


async def _connect(c: Coordinator) -> protocol.Link:
    host, port = c.address.rsplit(":", 1)
    reader, writer, session = await protocol.connect_async(host, int(port), SECRET)
    return protocol.Link(reader, writer, session)
