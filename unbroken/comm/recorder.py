"""The flight recorder: every collective and ring transfer of unbroken's groups, cheaply.

On the training thread recording is a few appends to bounded deques (no locks, no I/O, no
formatting): about 2.5 us per step for a collective and the step's metrics, against steps of
tens of milliseconds. The ring's transfer hooks are as thin; the per-connection window monitors
are fed from the coordinator connection's thread, which drains everything in small batches
with every heartbeat (:meth:`FlightRecorder.batch`), so analysis happens there and in the
coordinator, never on the training thread or in the exchange.

A collective record is ``[group, seq, op, nbytes, enter_ns, exit_ns, ok, members, rq_enter_ns,
rq_exit_ns]`` (monotonic ns; ``rq_*`` is the training thread's cumulative run-queue wait, see
:class:`RunQueueWait`); a transfer record ``[group, seq, direction, peer, ring_step, nbytes, post_ns, done_ns]``,
the peer being a replica id. Each connection also feeds an ICCL window monitor.

Link faults for the scenario suite live here too, because only the transport knows a link:
``UNBROKEN_LINK_FAULT="A-B:mb_s=20:step=30"`` slows both directions between replicas A and B
to 20 MB/s from step 30; ``"A-B:stall:step=30"`` stops the transfer A -> B for good;
``"A:mb_s=20:step=30"`` slows every connection of replica A (a slow node). The delay holds the
send after it is posted, as a slow wire would (see :func:`unbroken.comm.ring.ring_allreduce_sum`).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

from unbroken.diagnosis.window import WindowMonitor

ENV_LINK_FAULT = "UNBROKEN_LINK_FAULT"
STACK_SIGNAL = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class LinkFault:
    """A fault on the link between replicas ``a`` and ``b`` (``stall``: only a -> b).

    ``b`` None: every connection of replica ``a`` (a slow node; not with ``stall``).
    """

    a: int
    b: int | None
    step: int = 0
    mb_s: float | None = None
    stall: bool = False

    @classmethod
    def parse(cls, spec: str) -> LinkFault:
        try:
            link, *opts = spec.split(":")
            ends = [int(x) for x in link.split("-")]
            if len(ends) not in (1, 2):
                raise ValueError("the link is A-B (two replicas) or A (all of one replica's links)")
            a, b = ends[0], (ends[1] if len(ends) == 2 else None)
            kw: dict[str, Any] = {}
            for o in opts:
                if o == "stall":
                    kw["stall"] = True
                else:
                    k, v = o.split("=")
                    kw[k] = float(v) if k == "mb_s" else int(v)
            fault = cls(a, b, **kw)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{ENV_LINK_FAULT}={spec!r}: write A-B:mb_s=MB:step=N, A:mb_s=MB:step=N " f"or A-B:stall:step=N ({e})"
            ) from e
        if not fault.stall and not (fault.mb_s and fault.mb_s > 0):
            raise ValueError(f"{ENV_LINK_FAULT}={spec!r}: give mb_s > 0 or stall")
        if fault.stall and fault.b is None:
            raise ValueError(f"{ENV_LINK_FAULT}={spec!r}: a stall names one direction A-B, not a whole replica")
        return fault

    def delay_s(self, src: int, dst: int, step: int, nbytes: int) -> float | None:
        """Seconds to hold a send src -> dst (inf: forever), or None when not affected."""
        if step < self.step:
            return None
        if self.stall:
            return float("inf") if (src, dst) == (self.a, self.b) else None
        if {src, dst} == {self.a, self.b} or (self.b is None and self.a in (src, dst)):
            return nbytes / (self.mb_s * 1e6)  # type: ignore[operator]
        return None


class RunQueueWait:
    """The calling thread's cumulative time runnable but without a CPU (Linux schedstat), in ns.

    This is what tells "this rank is slow" from "this machine is busy": a rank whose compute is
    slow, or that sleeps, does not wait in the run queue; one whose CPU other processes hold
    does. Subtracting it from the time between two collectives leaves the rank's own compute
    time. Counts the training thread only (its intra-op helper threads are not read); 0 where
    the kernel does not say (then nothing is subtracted). One ``pread`` of about 2 us.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tid: int | None = None

    def read(self) -> int:
        tid = threading.get_native_id()
        if tid != self._tid:
            self._tid = tid
            if self._fd is not None:
                os.close(self._fd)
            try:
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                self._fd = None
        if self._fd is None:
            return 0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0


class FlightRecorder:
    """Bounded record of this rank's collectives and transfers, shipped off the hot path.

    Args:
        capacity: entries kept for a post-mortem dump (the ring).
        batch_max: most entries shipped per batch.
        replica: this rank's replica id (transfers name peers by replica id).
    """

    def __init__(self, replica: int, capacity: int = 2048, batch_max: int = 256) -> None:
        self.replica = replica
        self.batch_max = batch_max
        self.ring: deque[list[Any]] = deque(maxlen=capacity)
        self._out: deque[list[Any]] = deque(maxlen=capacity)
        self._links: deque[list[Any]] = deque(maxlen=capacity)
        self._steps: deque[list[Any]] = deque(maxlen=capacity)
        self._stalls: deque[list[Any]] = deque(maxlen=64)
        self._window: deque[tuple[str, int, int, int, int]] = deque(maxlen=capacity)
        self._seq: dict[str, int] = {}
        self.open: list[Any] | None = None
        self.open_links: dict[tuple[str, int], list[Any]] = {}
        self.monitors: dict[tuple[str, int], WindowMonitor] = {}
        self.step = 0
        self.run_queue = RunQueueWait()
        self.members: list[int] = []
        self.group = ""
        spec = os.environ.get(ENV_LINK_FAULT)
        self.link_fault = LinkFault.parse(spec) if spec else None

    # -- training thread -------------------------------------------------------------------

    def begin(self, group: str, op: str, nbytes: int, members: list[int]) -> list[Any]:
        seq = self._seq.get(group, -1) + 1
        self._seq[group] = seq
        self.group, self.members = group, members
        rec = [group, seq, op, nbytes, time.monotonic_ns(), 0, False, members, self.run_queue.read(), 0]
        self.open_links.clear()
        self.open = rec
        return rec

    def end(self, rec: list[Any], ok: bool | None) -> None:
        """``ok``: True done, False abandoned at its deadline (a stall), None failed for a known reason."""
        rec[5] = time.monotonic_ns()
        rec[6] = ok
        rec[9] = self.run_queue.read()
        self.open = None
        if ok:
            self.open_links.clear()
        else:
            # A failed collective ships its unfinished transfers as evidence (the next collective
            # clears open_links), with whether it gave up at its own deadline (a stall) or was
            # failed for it (the coordinator's abort after a peer's deadline, a closed connection).
            try:
                stalled = [[e[2], e[3], e[4], e[6]] for e in list(self.open_links.values())]
            except RuntimeError:  # changed under us by the ring thread
                stalled = []
            if stalled:
                self._stalls.append([rec[0], rec[1], stalled, ok is False])
        self.ring.append(rec)
        self._out.append(rec)

    def record_step(self, step: int, loss: float | None, grad_norm: float | None, memory: float | None) -> None:
        self.step = step
        self._steps.append([step, loss, grad_norm, memory])

    # -- ring hook (see unbroken.comm.ring.LinkHook) ------------------------------------------

    def posted(self, direction: str, peer: int, step: int, nbytes: int) -> int:
        rec = self.open
        seq = rec[1] if rec else -1
        replica = self.members[peer] if peer < len(self.members) else peer
        entry = [self.group, seq, direction, replica, step, nbytes, time.monotonic_ns(), 0]
        self.open_links[(direction, step)] = entry
        return step

    def done(self, direction: str, peer: int, step: int, token: int) -> None:
        entry = self.open_links.pop((direction, token), None)
        if entry is None:
            return
        entry[7] = time.monotonic_ns()
        self._links.append(entry)
        # At most a send and a receive are open at once: the sum is two additions. The window
        # monitors are fed from the connection thread (:meth:`batch`), off the exchange's path.
        waiting = sum(e[5] for e in self.open_links.values() if e[3] == entry[3])
        self._window.append((direction, entry[3], entry[5], entry[7] - entry[6], waiting))

    def send_delay_s(self, peer: int, step: int, nbytes: int) -> float:
        if self.link_fault is None:
            return 0.0
        dst = self.members[peer] if peer < len(self.members) else peer
        delay = self.link_fault.delay_s(self.replica, dst, self.step, nbytes)
        return 0.0 if delay is None else delay

    # -- connection thread ---------------------------------------------------------------

    def batch(self) -> dict[str, Any] | None:
        """Drains up to ``batch_max`` entries; None when there is nothing new and nothing open."""
        records = _drain(self._out, self.batch_max)
        links = _drain(self._links, self.batch_max)
        steps = _drain(self._steps, self.batch_max)
        stalls = _drain(self._stalls, self.batch_max)
        for direction, peer, nbytes, ns, waiting in _drain(self._window, len(self._window)):
            mon = self.monitors.get((direction, peer))
            if mon is None:
                mon = self.monitors[(direction, peer)] = WindowMonitor()
            mon.completed(nbytes, ns / 1e9, waiting)
        rec = self.open
        open_ = [rec[0], rec[1], rec[2], rec[3], rec[4], rec[7]] if rec else None
        try:
            open_links = [list(e[:7]) for e in list(self.open_links.values())]
        except RuntimeError:  # changed under us by the ring thread; the next batch has it
            open_links = []
        flags = [[d, p] for (d, p), m in self.monitors.items() if m.flagged]
        return {
            "now_ns": time.monotonic_ns(),
            "records": records,
            "open": open_,
            "links": links,
            "open_links": open_links,
            "stalls": stalls,
            "steps": steps,
            "flags": flags,
            "memory": _rss_bytes(),
        }


def _rss_bytes() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _drain(q: deque[Any], n: int) -> list[Any]:
    """Takes up to ``n`` entries; entries are complete when appended, so they are not copied."""
    out: list[Any] = []
    while q and len(out) < n:
        out.append(q.popleft())
    return out


class StackDump:
    """Writes every thread's Python stack to ``path`` when the process gets ``signum`` (hang verdicts).

    faulthandler writes from the C signal handler, so a rank stuck in a blocking C call (a
    sleep, a collective wait) still answers. A SIGSTOPped process cannot: the signal stays
    pending until SIGCONT. A handler the program installed before (Slurm's and Lightning's
    SIGUSR1 handlers) still runs after the dump: taking the signal over would break them. With
    no earlier handler nothing is chained, since the default action of SIGUSR1 ends the process.
    The handler stays for the life of the process: the diagnosis may still ask a finishing
    process for its stack, and with SIGUSR1's default action back that would kill it.
    """

    def __init__(self, path: str | os.PathLike[str], signum: int = STACK_SIGNAL) -> None:
        self.path = Path(path)
        self.signum = signum
        previous = signal.getsignal(signum)
        # None: a handler installed outside Python, which must keep working too.
        chain = previous is None or callable(previous)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file: IO[str] = open(self.path, "w")  # noqa: SIM115 - must stay open for the signal handler
        faulthandler.register(signum, file=self.file, all_threads=True, chain=chain)


def install_stack_dump(path: str | os.PathLike[str], signum: int = STACK_SIGNAL) -> StackDump:
    """Makes ``signum`` write every thread's Python stack to ``path`` (see :class:`StackDump`)."""
    return StackDump(path, signum)
