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
import gc
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """:func:`asyncio.run` on uvloop where it is installed, on asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


#: CPython collects its youngest generation every 700 container allocations by default; a server
#: that allocates a few dicts per line and holds thousands of connections promotes so much that
#: full collections follow one another. These: gen0 every 20,000, gen1 every 20 of those, a full
#: one after 100 gen1 collections (and CPython's own rule: only once the survivors since the last
#: full one are a quarter of the heap).
SERVER_GC_THRESHOLDS = (20_000, 20, 100)


def pace_gc_for_a_server() -> None:
    """Keeps the garbage collector's pauses out of the coordinator's answers.

    A full collection walks every object the process holds; for a coordinator of 5,000 replica
    groups that is about 90 ms during which no quorum is answered, and with CPython's default
    thresholds they came about twice a second (``gc.callbacks`` on ``unbroken bench coordinator
    --sizes 5000``: 42 pauses over 3 ms in one run, the longest 83 ms; with these thresholds and
    the import-time objects frozen, 14, the longest 6.7 ms). Cyclic garbage (a closed
    connection's transport and protocol) is still collected, less often.
    """
    gc.collect()
    gc.freeze()  # what the imports made lives as long as the process: never walked again
    gc.set_threshold(*SERVER_GC_THRESHOLDS)


def hold_gc() -> bool:
    """Stops the garbage collector for a burst (:func:`release_gc_when` restarts it); returns
    whether it was running."""
    running = gc.isenabled()
    gc.disable()
    return running


async def release_gc_when(done: Callable[[], bool], bound_s: float, running: bool, every_s: float = 0.05) -> None:
    """Restarts the collector stopped by :func:`hold_gc` once ``done()`` (or ``bound_s`` later),
    after moving what lives then out of its sight (:func:`gc.freeze`).

    A standby taking over builds the whole job's bookkeeping in one burst: every node's ranks,
    links and answers, all of it alive until the job ends. The collector ran 37 times in the burst
    of a 12,500-node takeover, for 0.58 s of its 3.8 s, two of those passes 0.2 s each, and freed
    96 objects. Stopped until the resumed epoch is whole, then freezing what was built, it costs
    nothing there, and later passes do not walk the job's bookkeeping again. The cyclic garbage
    of the burst, if any, is frozen with it: bounded by one burst of ``bound_s``.
    """
    try:
        deadline = time.monotonic() + bound_s
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(every_s)
    finally:
        gc.freeze()
        if running:
            gc.enable()


def listen_backlog(max_connections: int) -> int:
    """The listen backlog for a server that expects up to ``max_connections`` at once.

    asyncio's default is 100. When a coordinator dies, every replica group reconnects to the
    standby within a few milliseconds: past the backlog the kernel drops the SYNs, and each
    dropped client waits out TCP's retransmission timer (1 s, then 3 s): a 1,000-group
    takeover took 6.5 s that way. The kernel caps it at ``net.core.somaxconn``.
    """
    return max(128, max_connections)
