"""The coordinator's event loop: uvloop where installed, and a listen backlog for a takeover."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.live_coordinator import live_coordinator, member, next_op
from unbroken.control.protocol import event_loop
from unbroken.wire.auth import JobSecret

SECRET = JobSecret(b"k" * 32)


def test_run_uses_uvloop_when_it_is_installed() -> None:
    pytest.importorskip("uvloop")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(loop_module()).startswith("uvloop")


def test_the_backlog_covers_every_connection_the_coordinator_accepts() -> None:
    assert event_loop.listen_backlog(5000) == 5000
    assert event_loop.listen_backlog(1) == 128  # never below what a small job's burst needs


def _somaxconn() -> int:
    return int(Path("/proc/sys/net/core/somaxconn").read_text())


def test_the_coordinator_serves_on_uvloop_with_a_backlog_for_every_group(tmp_path: Path) -> None:
    """A standby's clients all reconnect at once: its listening socket must queue them all
    (``ss`` shows a listener's backlog as its Send-Q), and the protocol works on uvloop."""

    async def main() -> tuple[int, str]:
        async with live_coordinator(tmp_path, SECRET, max_connections=1000) as c:
            port = int(c.address.rsplit(":", 1)[1])
            link = await member(c, SECRET, replica=0)
            link.send({"op": "quorum", "id": 1, "step": 0})
            link.send({"op": "status"})
            status = await next_op(link, "status")
            out = subprocess.run(
                ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=10, check=True
            ).stdout
            link.close()
            return int(out.split()[2]), str(status["replicas"]["0"]["ranks"])

    backlog, ranks = event_loop.run(main())
    assert backlog == min(1000, _somaxconn())
    assert ranks == "1"


def test_the_collector_stays_off_through_a_burst_and_restarts_once_it_is_done() -> None:
    """A standby's takeover: no collection while the burst runs; after it, what was built is
    frozen out of later passes, and the collector runs again."""
    import gc

    frozen_before = gc.get_freeze_count()
    kept: list[list[int]] = []
    finished = False

    async def burst() -> list[bool]:
        nonlocal finished
        running = event_loop.hold_gc()
        releasing = asyncio.ensure_future(event_loop.release_gc_when(lambda: finished, 30.0, running, every_s=0.01))
        seen = []
        for _ in range(3):
            kept.extend([[i] for i in range(10_000)])  # the job's bookkeeping, alive after the burst
            await asyncio.sleep(0.02)
            seen.append(gc.isenabled())
        finished = True
        await asyncio.wait_for(releasing, 5.0)
        return seen

    try:
        assert asyncio.run(burst()) == [False, False, False]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(kept)  # out of every later pass
    finally:
        gc.unfreeze()
        gc.enable()


def test_the_collector_restarts_after_its_bound_if_the_burst_never_ends() -> None:
    import gc

    async def stuck() -> float:
        running = event_loop.hold_gc()
        t = asyncio.get_running_loop().time()
        await event_loop.release_gc_when(lambda: False, 0.1, running, every_s=0.01)
        return asyncio.get_running_loop().time() - t

    try:
        assert 0.1 <= asyncio.run(stuck()) < 2.0
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
