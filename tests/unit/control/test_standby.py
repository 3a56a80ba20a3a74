"""A standby coordinator, without the command line: it listens from the start, serves nothing,
and wins the state directory when the active coordinator hangs (its lease lapses) or dies (its
lock is freed). Real sockets, a real lease on a temporary directory."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from unbroken.control import protocol
from unbroken.control.coordinator_settings import CoordinatorSettings
from unbroken.control.standby import Standby
from unbroken.control.state.lease import LeaseFiles, claim_next
from unbroken.control.state.state_store import lock_state_dir
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()


def test_a_standby_listens_serves_nothing_and_wins_a_hung_coordinators_lease(tmp_path: Path) -> None:
    lock = lock_state_dir(tmp_path)  # the active coordinator: alive (its lock held), hung (no renewals)
    files = LeaseFiles(tmp_path)
    claim_next(files, 0.3)

    async def main() -> None:
        standby = Standby(CoordinatorSettings(total_replicas=2, state_dir=tmp_path), SECRET, files, lease_s=0.3)
        await standby.listen()
        try:
            host, port = standby.address.rsplit(":", 1)
            reader, writer, session = await protocol.connect_async(host, int(port), SECRET)  # held, not served
            won = await asyncio.wait_for(standby.wait(asyncio.Event()), 10)
            assert won is not None and won.lock_fd is None and won.lease.term == 2
            assert files.newest() is not None and files.newest().holder == won.lease.holder  # type: ignore[union-attr]
            assert standby.listening is not None and len(standby.listening[0].open) == 1  # held for the takeover
            writer.close()
        finally:
            standby.close()

    try:
        asyncio.run(main())
    finally:
        os.close(lock)


def test_a_standby_told_to_stop_wins_nothing(tmp_path: Path) -> None:
    lock = lock_state_dir(tmp_path)
    claim_next(LeaseFiles(tmp_path), 30.0)

    async def main() -> None:
        standby = Standby(CoordinatorSettings(total_replicas=2, state_dir=tmp_path), SECRET, LeaseFiles(tmp_path), 30.0)
        await standby.listen()
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        try:
            assert await asyncio.wait_for(standby.wait(stop), 10) is None
        finally:
            standby.close()

    try:
        asyncio.run(main())
    finally:
        os.close(lock)
