"""What the caller of the ICCL ring holds: the future of a collective, and the ring's errors.

``IcclWork`` has the surface of a backend's work and future at once (``done``, ``wait``,
``exception``, ``add_done_callback``, ``get_future``), so that code written for Gloo's futures
drives the ring unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class RingBroken(RuntimeError):
    """The ring cannot complete its collectives: both paths of a hop are gone, or it was closed."""


class FaultHook(Protocol):
    """Alters what goes on the wire (benchmarks and tests: a corrupting NIC)."""

    def payload(self, seq: int, chunk: int, path: int, data: memoryview) -> memoryview | bytes: ...


class IcclWork:
    """The future of one all-reduce: ``done()``, ``wait()``, ``exception()``, callbacks."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[IcclWork], None]] = []
        self._lock = threading.Lock()
        self.started = time.perf_counter()
        self.finished: float | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done (or ``timeout``: TimeoutError); raises the collective's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the all-reduce did not complete in {timeout} s")
        if self._error is not None:
            raise self._error

    def get_future(self) -> IcclWork:
        """Itself: the work is its own future (the backend's ``work.get_future()`` shape)."""
        return self

    def add_done_callback(self, fn: Callable[[IcclWork], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error, self.finished = error, time.perf_counter()
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
