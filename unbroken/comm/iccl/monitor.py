"""The window monitor on each outgoing ICCL connection, and the port verdicts it feeds.

Every acknowledgement gives one sample: the bytes it acknowledged, over the time since the later of
their post and the previous acknowledgement on that connection (a pipelined link's service time,
not its queueing), and the bytes still outstanding. :class:`~unbroken.diagnosis.rules.window.WindowMonitor`
flags the connection when throughput halves while data waits. Failures (a path down, a stall
past the bound) are counted with their times, so that a port that fails once is named
``failing`` and one that fails again within :data:`FLAP_WINDOW_S` ``flapping``: a link verdict
naming (host, interface, peer). All of it is O(1) per chunk: ICCL found monitoring could double
host CPU, so nothing here walks a history.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from unbroken.comm.iccl.protocol import PATH_NAMES, HopPaths
from unbroken.diagnosis.rules.links import port_findings
from unbroken.diagnosis.rules.window import WindowMonitor

FLAP_WINDOW_S = 30.0
MAX_DOWNS = 64
MAX_LOG = 512


class PathLog:
    """This process's path events (down, up, failover, failback, flagged), newest last, bounded;
    readers take what is new since their last read (:meth:`since`). A worker's metrics and the
    diagnosis read it; every ring of the process writes to :data:`PATH_LOG`."""

    def __init__(self, capacity: int = MAX_LOG) -> None:
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self.count = 0
        self.corrupt_chunks = 0  # chunks that arrived failing their CRC (resent, never summed)
        self.corrupted_sent = 0  # chunks an injected fault altered on their way out

    def add(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        self.count += 1

    def since(self, count: int) -> tuple[list[dict[str, Any]], int]:
        """The events after the ``count``-th (as many as are still kept), and the new count."""
        total = self.count
        new = min(total - count, len(self._events))
        return (list(self._events)[-new:] if new > 0 else []), total


PATH_LOG = PathLog()


class LinkWatch:
    """The monitors and failure record of the two outgoing connections of one hop."""

    def __init__(self, host: str, interfaces: tuple[str, str], peer: int) -> None:
        self.host, self.interfaces, self.peer = host, interfaces, peer
        self.monitors = [WindowMonitor(), WindowMonitor()]
        self.bytes_sent = [0, 0]
        self.bytes_acked = [0, 0]
        self.flags = [0, 0]  # times the window monitor flagged the connection
        self._last_done = [0.0, 0.0]
        self._downs: list[collections.deque[tuple[float, str]]] = [
            collections.deque(maxlen=MAX_DOWNS),
            collections.deque(maxlen=MAX_DOWNS),
        ]
        self.last_event: list[str] = ["", ""]

    def sent(self, path: int, nbytes: int) -> None:
        self.bytes_sent[path] += nbytes

    def acked(self, path: int, nbytes: int, first_post: float, now: float, outstanding: int) -> bool:
        """One acknowledgement; whether the monitor flags the connection now."""
        seconds = now - max(first_post, self._last_done[path])
        self._last_done[path] = now
        self.bytes_acked[path] += nbytes
        mon = self.monitors[path]
        was = mon.flagged
        flagged = mon.completed(nbytes, seconds, outstanding)
        if flagged and not was:
            self.flags[path] += 1
            self._log(time.time(), path, "flagged", f"throughput {mon.throughput_bps / 1e6:.1f} MB/s")
        return flagged

    def failed(self, path: int, why: str) -> None:
        t = time.time()
        self._downs[path].append((t, why))
        self.last_event[path] = f"down: {why}"
        self._log(t, path, "down", why)

    def event(self, path: int, what: str) -> None:
        self.last_event[path] = what
        self._log(time.time(), path, what, "")

    def _log(self, t: float, path: int, what: str, why: str) -> None:
        PATH_LOG.add(
            {
                "t": t,
                "host": self.host,
                "interface": self.interfaces[path],
                "path": PATH_NAMES[path],
                "peer": self.peer,
                "what": what,
                "why": why[:200],
            }
        )

    def verdicts(self, now: float | None = None) -> list[dict[str, Any]]:
        """This hop's ports that failed in the last :data:`FLAP_WINDOW_S`
        (:func:`~unbroken.diagnosis.rules.links.port_findings`: ``failing`` once, ``flapping`` more)."""
        events = [
            {
                "t": t,
                "host": self.host,
                "interface": self.interfaces[path],
                "peer": self.peer,
                "what": "down",
                "why": why,
            }
            for path in (0, 1)
            for t, why in self._downs[path]
        ]
        return [f.to_json() for f in port_findings(events, time.time() if now is None else now, FLAP_WINDOW_S)]

    def stats(self, paths: HopPaths) -> list[dict[str, Any]]:
        rows = []
        for path in (0, 1):
            mon = self.monitors[path]
            rows.append(
                {
                    "host": self.host,
                    "interface": self.interfaces[path],
                    "path": PATH_NAMES[path],
                    "peer": self.peer,
                    "up": paths.up[path],
                    "active": paths.active == path,
                    "bytes_sent": self.bytes_sent[path],
                    "bytes_acked": self.bytes_acked[path],
                    "throughput_bps": mon.throughput_bps,
                    "mean_bps": mon.mean_bps or 0.0,
                    "flagged": mon.flagged,
                    "flags": self.flags[path],
                    "downs": paths.downs[path],
                    "last_event": self.last_event[path],
                }
            )
        rows[1]["failovers"] = paths.failovers
        rows[0]["failbacks"] = paths.failbacks
        return rows
