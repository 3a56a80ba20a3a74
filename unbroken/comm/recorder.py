"""The flight recorder: every collective and ring transfer of unbroken's groups, cheaply.

On the training thread recording is a few appends to bounded deques (no locks, no I/O, no
formatting): about 2.5 us per step for a collective and the step's metrics, against steps of
tens of milliseconds. The ring's transfer hooks are as thin; the per-connection window monitors
are fed from the coordinator connection's thread, which drains everything in small batches
with every heartbeat (:meth:`FlightRecorder.batch`), so analysis happens there and in the
coordinator, never on the training thread or in the exchange.

Records are the typed rows of :mod:`unbroken.diagnosis.telemetry` (a :class:`Collective`, a
:class:`Transfer`; monotonic ns), and a batch is a :class:`TelemetryBatch`. Each connection also
feeds an ICCL window monitor.

As the ring's :class:`~unbroken.comm.ring_allreduce.LinkHook` the recorder also carries a link fault when
one is injected (:class:`LinkDelay`, :mod:`unbroken.faults.link`): only the transport knows a
link. The recorder is given it; it never reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from typing import Any, Protocol

from unbroken.comm.iccl.monitor import PATH_LOG
from unbroken.comm.runqueue import RunQueueWait
from unbroken.diagnosis.rules.window import WindowMonitor
from unbroken.diagnosis.telemetry import (
    MAX_COSTS,
    PATH_EVENTS,
    CaughtUp,
    CheckpointPersisted,
    CheckpointSaved,
    Collective,
    FlaggedLink,
    PathEvent,
    SdcFound,
    Stall,
    StepMetrics,
    TelemetryBatch,
    Transfer,
)


class LinkDelay(Protocol):
    """An injected link fault (:class:`unbroken.faults.link.LinkFault` is one)."""

    def delay_s(self, src: int, dst: int, step: int, nbytes: int) -> float | None:
        """Seconds to hold a send from replica ``src`` to ``dst`` (inf: forever); None: unaffected."""
        ...


class FlightRecorder:
    """Bounded record of this rank's collectives and transfers, shipped off the hot path.

    Args:
        capacity: entries kept for a post-mortem dump (the ring).
        batch_max: most entries shipped per batch.
        replica: this rank's replica id (transfers name peers by replica id).
        link_fault: an injected link fault that delays this rank's sends; None in real jobs.
    """

    def __init__(
        self, replica: int, capacity: int = 2048, batch_max: int = 256, link_fault: LinkDelay | None = None
    ) -> None:
        self.replica = replica
        self.batch_max = batch_max
        self.ring: deque[Collective] = deque(maxlen=capacity)
        self._out: deque[Collective] = deque(maxlen=capacity)
        self._links: deque[Transfer] = deque(maxlen=capacity)
        self._steps: deque[StepMetrics] = deque(maxlen=capacity)
        self._stalls: deque[Stall] = deque(maxlen=64)
        self._costs: deque[CheckpointSaved | CheckpointPersisted | CaughtUp | SdcFound] = deque(maxlen=MAX_COSTS)
        self._paths_seen = PATH_LOG.count  # port events of this process already shipped
        self._window: deque[tuple[str, int, int, int, int]] = deque(maxlen=capacity)
        self._seq: dict[str, int] = {}
        self.open: Collective | None = None
        self.open_links: dict[tuple[str, int], Transfer] = {}
        self.monitors: dict[tuple[str, int], WindowMonitor] = {}
        self.step = 0
        self.run_queue = RunQueueWait()  # the training thread's
        self.ring_run_queue = RunQueueWait()  # the ring's thread's (a slow link or a busy host?)
        self.members: list[int] = []
        self.group = ""
        self.link_fault = link_fault

    # -- training thread -------------------------------------------------------------------

    def begin(self, group: str, op: str, nbytes: int, members: list[int]) -> Collective:
        seq = self._seq.get(group, -1) + 1
        self._seq[group] = seq
        self.group, self.members = group, members
        rec = Collective(group, seq, op, nbytes, time.monotonic_ns(), 0, False, members, self.run_queue.read(), 0)
        self.open_links.clear()
        self.open = rec
        return rec

    def extend_last(self, group: str) -> None:
        """The last collective of ``group``, if it completed, lasts until now: an unrecorded
        follow-up on the same group (the exchange's fingerprint swap) belongs to it, so the
        time it takes is neither a collective of its own nor this rank's compute."""
        last = self.ring[-1] if self.ring else None
        if last is not None and last.group == group and last.ok:
            last.exit_ns = time.monotonic_ns()

    def end(self, rec: Collective, ok: bool | None) -> None:
        """``ok``: True done, False abandoned at its deadline (a stall), None failed for a known reason."""
        rec.exit_ns = time.monotonic_ns()
        rec.ok = ok
        rec.rq_exit_ns = self.run_queue.read()
        self.open = None
        if ok:
            self.open_links.clear()
        else:
            # A failed collective ships its unfinished transfers as evidence (the next collective
            # clears open_links), with whether it gave up at its own deadline (a stall) or was
            # failed for it (the coordinator's abort after a peer's deadline, a closed connection).
            try:
                stalled = list(self.open_links.values())
            except RuntimeError:  # changed under us by the ring thread
                stalled = []
            if stalled:
                self._stalls.append(Stall(rec.group, rec.seq, stalled, ok is False))
        self.ring.append(rec)
        self._out.append(rec)

    def record_step(self, step: int, loss: float | None, grad_norm: float | None, memory: float | None) -> None:
        self.step = step
        self._steps.append(StepMetrics(step, loss, grad_norm, memory))

    def note(self, cost: CheckpointSaved | CheckpointPersisted | CaughtUp | SdcFound) -> None:
        """A checkpoint's or a catch-up's cost, or a corruption found, shipped with the next
        batch (any thread)."""
        self._costs.append(cost)

    # -- ring hook (see unbroken.comm.ring_allreduce.LinkHook) ------------------------------------------

    def posted(self, direction: str, peer: int, step: int, nbytes: int) -> int:
        rec = self.open
        seq = rec.seq if rec else -1
        replica = self.members[peer] if peer < len(self.members) else peer
        rq = self.ring_run_queue.read() if direction == "recv" else 0  # only a receiver's wait is used
        entry = Transfer(self.group, seq, direction, replica, step, nbytes, time.monotonic_ns(), 0, rq, rq)
        self.open_links[(direction, step)] = entry
        return step

    def done(self, direction: str, peer: int, step: int, token: int) -> None:
        entry = self.open_links.pop((direction, token), None)
        if entry is None:
            return
        entry.done_ns = time.monotonic_ns()
        if direction == "recv":
            entry.rq_done_ns = self.ring_run_queue.read()
        self._links.append(entry)
        # At most a send and a receive are open at once: the sum is two additions. The window
        # monitors are fed from the connection thread (:meth:`batch`), off the exchange's path.
        waiting = sum(e.nbytes for e in self.open_links.values() if e.peer == entry.peer)
        self._window.append((direction, entry.peer, entry.nbytes, entry.done_ns - entry.post_ns, waiting))

    def send_delay_s(self, peer: int, step: int, nbytes: int) -> float:
        if self.link_fault is None:
            return 0.0
        dst = self.members[peer] if peer < len(self.members) else peer
        delay = self.link_fault.delay_s(self.replica, dst, self.step, nbytes)
        return 0.0 if delay is None else delay

    # -- connection thread ---------------------------------------------------------------

    def batch(self) -> TelemetryBatch:
        """Drains up to ``batch_max`` entries of each kind, with what is open now."""
        records = _drain(self._out, self.batch_max)
        links = _drain(self._links, self.batch_max)
        steps = _drain(self._steps, self.batch_max)
        stalls = _drain(self._stalls, self.batch_max)
        costs = _drain(self._costs, MAX_COSTS)
        for direction, peer, nbytes, ns, waiting in _drain(self._window, len(self._window)):
            mon = self.monitors.get((direction, peer))
            if mon is None:
                mon = self.monitors[(direction, peer)] = WindowMonitor()
            mon.completed(nbytes, ns / 1e9, waiting)
        try:
            # Copies: the ring thread finishes these in place while the batch is being encoded.
            open_links = [dataclasses.replace(e) for e in list(self.open_links.values())]
        except RuntimeError:  # changed under us by the ring thread; the next batch has it
            open_links = []
        return TelemetryBatch(
            now_ns=time.monotonic_ns(),
            records=records,
            open=None if self.open is None else dataclasses.replace(self.open),
            links=links,
            open_links=open_links,
            stalls=stalls,
            steps=steps,
            flags=[FlaggedLink(d, p) for (d, p), m in self.monitors.items() if m.flagged],
            memory=_rss_bytes(),
            saved=[c for c in costs if isinstance(c, CheckpointSaved)],
            persisted=[c for c in costs if isinstance(c, CheckpointPersisted)],
            caught_up=[c for c in costs if isinstance(c, CaughtUp)],
            paths=self._path_events(),
            sdc=[c for c in costs if isinstance(c, SdcFound)],
        )

    def _path_events(self) -> list[PathEvent]:
        """The ICCL rings' port events since the last batch (:data:`~unbroken.comm.iccl.monitor.PATH_LOG`),
        at most :data:`MAX_COSTS` of them, as ages."""
        events, self._paths_seen = PATH_LOG.since(self._paths_seen)
        now = time.time()
        return [
            PathEvent(
                max(0.0, now - e["t"]), e["host"][:64], e["interface"][:64], int(e["peer"]), e["what"], e["why"][:200]
            )
            for e in events[-MAX_COSTS:]
            if e.get("what") in PATH_EVENTS
        ]


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
