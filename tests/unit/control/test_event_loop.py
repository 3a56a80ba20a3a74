"""The coordinator's event loop: uvloop where installed, and a listen backlog for a takeover."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.live_coordinator import live_coordinator, member, next_op
from unbroken.control import event_loop
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
