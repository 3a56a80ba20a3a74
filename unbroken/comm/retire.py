"""Releasing the groups that epochs leave behind, off the training thread.

Every membership change builds a new cross-replica group; the old one must go, or a long job
keeps every epoch's sockets, threads and (with NCCL) hundreds of MiB of GPU memory. It cannot
simply be dropped on the training thread:

* a Gloo group whose operation is still running (a peer died mid-collective) blocks its
  destructor until that operation times out, and its ``abort()`` does not end the operation;
  once every operation has completed, with an error or not, it is released in milliseconds;
* an NCCL communicator is released by ``abort()``, which can itself block (a call stuck in
  NCCL), and must not be left for NCCL's watchdog to find.

So a retired group goes to a :class:`GroupReaper`: one thread that aborts NCCL groups (each
abort bounded by a watchdog thread, and never beside the building of a new communicator in
this process: :data:`NCCL_LIFECYCLE`), waits for a Gloo group's operations to end (bounded by the
group's own timeout plus a margin), then drops the last reference. A group whose operations
outlive that bound is stuck: it is kept, never destroyed (its destructor could block or, with
its peer gone, throw and abort the process), and counted; :attr:`GroupReaper.stuck` is
bounded by how many operations can be stuck at once, which each epoch's deadline limits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)


class BoundedLock:
    """A lock taken for at most ``timeout_s``: past that the holder is presumed stuck and the
    caller goes on without it (and says so), so one stuck NCCL call cannot stop every later one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.waited_out = 0  # how often a caller gave up waiting

    @contextlib.contextmanager
    def hold(self, timeout_s: float) -> Iterator[None]:
        got = self._lock.acquire(timeout=timeout_s)
        if not got:
            self.waited_out += 1
            log.warning("%s: still held after %.0fs (a stuck NCCL call?); going on without it", self.name, timeout_s)
        try:
            yield
        finally:
            if got:
                self._lock.release()


#: Held while an NCCL communicator of this process is built or aborted. Aborting one on the
#: reaper's thread while the next epoch's is being built made the build fail on an H200 (torch
#: 2.11, NCCL 2.28: ``Failed to CUDA calloc async``, about the eighth epoch); one at a time,
#: both are milliseconds and neither is on the training thread.
NCCL_LIFECYCLE = BoundedLock("the NCCL build/abort lock")


class Work(Protocol):
    def done(self) -> bool: ...


@dataclasses.dataclass(eq=False)
class Retired:
    """A group an epoch left behind, with the operations that were started on it."""

    group: Any
    backend: str
    epoch: int | None
    works: Sequence[Work]
    at: float
    aborted: bool = False


def fate(item: Retired, now: float, linger_s: float) -> str:
    """What the reaper does with ``item`` now: ``abort`` (NCCL, not yet aborted), ``release``
    (nothing runs on it any more: every operation ended, or NCCL's abort returned), ``wait`` (a
    Gloo operation still runs) or ``stuck`` (one ran past ``linger_s`` after the group was
    retired)."""
    if item.backend == "nccl":  # an aborted communicator's work is over, done or not
        return "release" if item.aborted else "abort"
    if all(w.done() for w in item.works):
        return "release"
    return "stuck" if now - item.at > linger_s else "wait"


def keep_forever(group: Any) -> None:
    """Leaks one reference to ``group`` so that its destructor never runs."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


class GroupReaper:
    """Releases retired groups on its own thread; see the module's docstring.

    Args:
        linger_s: how long a retired group's operations may run on before it is called stuck
            (the backend's timeout plus a margin: a Gloo operation ends by then).
        abort_timeout_s: how long one ``abort()`` may take before it is called stuck.
        poll_s: how often groups with running operations are looked at again.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        linger_s: float,
        abort_timeout_s: float = 10.0,
        poll_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.linger_s, self.abort_timeout_s, self.poll_s, self.clock = linger_s, abort_timeout_s, poll_s, clock
        self._waiting: deque[Retired] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._releasing = False  # a released group's destructor is running on the reaper's thread
        self.released = 0
        self.aborted = 0
        self.stuck = 0  # kept forever: an operation or an abort never ended
        self.abort_errors = 0
        self.abort_s: deque[float] = deque(maxlen=256)  # how long the latest aborts took (what abort costs)
        # At interpreter exit, groups still waiting are kept: destroyed during finalization, with
        # this daemon thread frozen, a Gloo group's threads end in std::terminate.
        atexit.register(self.close)

    def retire(self, group: Any, backend: str, epoch: int | None, works: Sequence[Work] = ()) -> None:
        """Hands ``group`` over; the caller drops its own references at once."""
        with self._cond:
            self._waiting.append(Retired(group, backend, epoch, list(works), self.clock()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="unbroken-group-reaper", daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def pending(self) -> int:
        """Groups retired and not yet released (nor called stuck)."""
        with self._cond:
            return len(self._waiting)

    def drain(self, timeout_s: float) -> bool:
        """Waits until every retired group is released (its destructor over: a process that exits
        while one runs on this daemon thread ends in std::terminate) or called stuck; False on
        timeout."""
        return self._wait_for(lambda: not self._waiting and not self._releasing, timeout_s)

    def settle(self, backend: str, most: int, timeout_s: float) -> bool:
        """Waits until at most ``most`` retired groups of ``backend`` are still waiting; False on
        timeout. An NCCL communicator holds hundreds of MiB of GPU memory (about 390 MiB for one
        rank on an H200) and its abort takes about a second (torch 2.11, NCCL 2.28), so epochs
        that change faster than that would pile communicators up without this bound."""
        return self._wait_for(lambda: sum(1 for i in self._waiting if i.backend == backend) <= most, timeout_s)

    def _wait_for(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Waits, nudging the reaper's thread, until ``done()`` (read under the lock); False on timeout."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while not done():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.notify()
                self._cond.wait(min(left, self.poll_s))
        return True

    def close(self) -> None:
        """Stops the thread; groups still waiting are kept (never destroyed)."""
        with self._cond:
            self._closed = True
            for item in self._waiting:
                keep_forever(item)  # the group and the works held with it
            self._waiting.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                items = list(self._waiting)
            over: set[int] = set()  # ids of the items released or called stuck in this pass
            item: Retired | None = None
            while items:
                item = items.pop()
                action = fate(item, self.clock(), self.linger_s)
                if action == "abort":
                    self._abort(item)
                    action = "release" if item.aborted else "stuck"
                if action == "stuck":
                    self.stuck += 1
                    keep_forever(item.group)
                    log.error(
                        "the %s group of epoch %s is stuck (an operation or its abort did not end in time): "
                        "kept, not destroyed (%d so far)",
                        item.backend,
                        item.epoch,
                        self.stuck,
                    )
                elif action == "release":
                    self.released += 1
                if action != "wait":
                    over.add(id(item))
            with self._cond:
                old, self._waiting = self._waiting, deque(i for i in self._waiting if id(i) not in over)
                self._releasing = bool(over)
            nccl = any(i.backend == "nccl" and id(i) in over for i in old)
            with NCCL_LIFECYCLE.hold(self.abort_timeout_s) if nccl else contextlib.nullcontext():
                del old, item  # the last references to released groups go here, on this thread
            with self._cond:
                self._releasing = False
                self._cond.notify_all()
                if not self._closed:
                    self._cond.wait(self.poll_s if self._waiting else None)

    def _abort(self, item: Retired) -> None:
        """NCCL's ``abort()`` on a watchdog thread: a call stuck in NCCL holds that thread only."""
        ended = threading.Event()

        def run() -> None:
            try:
                # Half the watchdog's bound: past a stuck holder, this abort still ends in time.
                with NCCL_LIFECYCLE.hold(self.abort_timeout_s / 2):
                    item.group.abort()
            except Exception as e:  # noqa: BLE001 - an abort that fails has still ended
                self.abort_errors += 1
                log.warning("aborting the group of epoch %s failed: %s", item.epoch, e)
            finally:
                ended.set()

        started = time.perf_counter()
        threading.Thread(target=run, name=f"unbroken-abort-epoch{item.epoch}", daemon=True).start()
        if ended.wait(self.abort_timeout_s):
            self.abort_s.append(time.perf_counter() - started)
            item.aborted = True
            self.aborted += 1
