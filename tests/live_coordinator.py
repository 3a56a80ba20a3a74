"""A real coordinator in the test's own event loop, and authenticated connections to it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from unbroken.control import protocol
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.wire.auth import JobSecret


@contextlib.asynccontextmanager
async def live_coordinator(state_dir: Path, secret: JobSecret, **settings: Any) -> AsyncIterator[Coordinator]:
    settings.setdefault("total_replicas", 3)
    c = Coordinator(CoordinatorSettings(state_dir=state_dir, **settings), secret)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


async def connect(c: Coordinator, secret: JobSecret) -> protocol.Link:
    host, port = c.address.rsplit(":", 1)
    reader, writer, session = await protocol.connect_async(host, int(port), secret)
    return protocol.Link(reader, writer, session)


async def member(
    c: Coordinator, secret: JobSecret, replica: int, rank: int = 0, world_size: int = 1, **hello: Any
) -> protocol.Link:
    """A connection that said hello as ``replica``/``rank`` and was welcomed."""
    link = await connect(c, secret)
    link.send({"op": "hello", "replica": replica, "rank": rank, "world_size": world_size, "transfer_addr": "", **hello})
    await next_op(link, "welcome")
    return link


async def next_op(link: protocol.Link, op: str, timeout: float = 5.0) -> dict[str, Any]:
    """The next message ``op`` on ``link`` (others skipped); TimeoutError, or EOFError if it closes."""

    async def read() -> dict[str, Any]:
        while True:
            line = await link.readline()
            if line is None:
                raise EOFError(f"the connection closed before an {op!r}")
            msg = link.decode(line)
            if msg["op"] == op:
                return msg

    return await asyncio.wait_for(read(), timeout)


async def closed(link: protocol.Link, timeout: float = 5.0) -> bool:
    """Whether the coordinator closes ``link`` within ``timeout`` (what it sends meanwhile is read)."""

    async def drain() -> None:
        while await link.readline() is not None:
            pass

    try:
        await asyncio.wait_for(drain(), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return False
    except ConnectionError:
        pass
    return True
