"""The coordinator's timer outlives an exception in one of its ticks."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.live_coordinator import closed, live_coordinator, member
from unbroken.wire.auth import JobSecret


async def _evicted_although_every_tick_raises(state_dir: Path) -> bool:
    secret = JobSecret.generate()
    async with live_coordinator(state_dir, secret, total_replicas=2, heartbeat_timeout_s=0.5, suspect_after_s=0.2) as c:

        def broken() -> None:
            raise RuntimeError("a bug in one part of the tick")

        c.diagnosis.tick = broken  # type: ignore[method-assign]
        link = await member(c, secret, replica=1)  # from now on this replica is silent (hung)
        try:
            if not await closed(link, 10):
                return False  # never evicted: the timer died
            return c.tick_errors > 0 and 1 not in c.quorum.alive
        finally:
            link.close()


def test_a_silent_replica_is_evicted_even_if_every_tick_raises(tmp_path: Path) -> None:
    assert asyncio.run(_evicted_although_every_tick_raises(tmp_path))
