"""The event loop the coordinator (and the simulated replica groups that load it) run on.

The coordinator is one asyncio event loop that every rank's quorum asks, heartbeats and
telemetry go through. At 1,000 replica groups a third of that loop's time was asyncio's own
Python (stream reads, transport writes, callbacks: ``py-spy`` on ``unbroken bench
coordinator``), so the coordinator runs on uvloop (libuv, the loop of ``uvicorn``), a drop-in
event loop that does that work in C. Where uvloop is not installed, the standard loop serves
unchanged: nothing in the coordinator depends on which loop it gets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """:func:`asyncio.run` on uvloop where it is installed, on asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def listen_backlog(max_connections: int) -> int:
    """The listen backlog for a server that expects up to ``max_connections`` at once.

    asyncio's default is 100. When a coordinator dies, every replica group reconnects to the
    standby within a few milliseconds: past the backlog the kernel drops the SYNs, and each
    dropped client waits out TCP's retransmission timer (1 s, then 3 s): a 1,000-group
    takeover took 6.5 s that way. The kernel caps it at ``net.core.somaxconn``.
    """
    return max(128, max_connections)
