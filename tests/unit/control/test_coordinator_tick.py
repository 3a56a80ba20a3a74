"""The coordinator's timer outlives an exception in one of its ticks."""

from __future__ import annotations

import asyncio
from pathlib import Path

from unbroken.control import protocol
from unbroken.control.coordinator import Coordinator, CoordinatorSettings


async def _evicted_although_every_tick_raises(state_dir: Path) -> bool:
    c = Coordinator(CoordinatorSettings(total_replicas=2, state_dir=state_dir, heartbeat_timeout_s=0.5,
                                        suspect_after_s=0.2))

    def broken() -> None:
        raise RuntimeError("a bug in one part of the tick")

    c.diagnosis.tick = broken  # type: ignore[method-assign]
    await c.start()
    host, port = c.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(protocol.encode({"op": "hello", "replica": 1, "rank": 0, "world_size": 1}))
        await reader.readline()  # welcome; from now on this replica is silent (hung)
        try:
            while await asyncio.wait_for(reader.readline(), 10):
                pass
        except asyncio.TimeoutError:
            return False  # never evicted: the timer died
        return c.tick_errors > 0 and 1 not in c.quorum.alive
    finally:
        writer.close()
        await c.stop()


def test_a_silent_replica_is_evicted_even_if_every_tick_raises(tmp_path: Path) -> None:
    assert asyncio.run(_evicted_although_every_tick_raises(tmp_path))
