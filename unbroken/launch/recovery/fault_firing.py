"""Firing ``unbroken run``'s scheduled faults when they fall due (``--fault``, ``--schedule``).

The schedule (:mod:`unbroken.faults.schedule`) says what and when; this module fires each fault
once, at its step or second, and records it. Faults that act on processes are carried out here:
``crash`` (``SIGKILL``) and ``hang`` (``SIGSTOP``, then ``SIGCONT`` after ``duration_s``) on one
rank, ``disk_full`` on a replica's checkpoint writers, ``coordinator_kill`` through the
supervisor, which owns the coordinator. A worker fault (``slow_rank``, ``slow_link``,
``nan_loss``) is applied by the worker itself from its environment: firing it only records when
it began, which the re-admission self-check needs to hand a slot the slowness still in effect
(:meth:`FaultFiring.slow_faults_on`).

Kept out of the supervisor's loop so that the loop reads as supervision; what the faults act on
(the replicas' processes, the job's step, the coordinator) comes in through the constructor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from unbroken.faults import supervisor as injector
from unbroken.faults.schedule import SUPERVISOR_KINDS, Fault, Schedule
from unbroken.observe.events import EventLog


class FaultFiring:
    """Fires a schedule's faults once each, when due.

    Args:
        schedule: the faults to fire.
        events: the supervisor's event log (``fault_injected``, ``fault_skipped``, ...).
        procs_of: a replica's running processes, by rank.
        job_step: the job's step now (recorded with each fault).
        restart_coordinator: stops the in-process coordinator, waits the given seconds,
            starts a fresh one on the same port and state and returns its address.
        run_task: runs a coroutine as one of the supervisor's tasks (cancelled at its end).
    """

    def __init__(
        self,
        schedule: Schedule,
        events: EventLog,
        procs_of: Callable[[int], list[asyncio.subprocess.Process]],
        job_step: Callable[[], int],
        restart_coordinator: Callable[[float], Awaitable[str]],
        run_task: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.schedule = schedule
        self.events = events
        self.procs_of = procs_of
        self.job_step = job_step
        self.restart_coordinator = restart_coordinator
        self.run_task = run_task
        self.fired: set[int] = set()  # indices into the schedule
        self.worker_fault_start: dict[int, float] = {}  # index -> when a worker fault began (wall)

    def fire_due(self, step: int, elapsed_s: float) -> None:
        """Starts every fault due at the job's ``step`` and ``elapsed_s`` since it began."""
        for i, f in enumerate(self.schedule):
            if i in self.fired or not f.due(step, elapsed_s):
                continue
            self.fired.add(i)
            self.run_task(self._inject(i, f))

    def slow_faults_on(self, replica: int, now: float) -> list[Fault]:
        """The ``slow_rank`` faults of ``replica``'s home slot still in effect at ``now``, as
        they would be fired afresh (at once, for what is left of their duration)."""
        return [
            dataclasses.replace(
                f,
                step=0,
                at_s=None,
                duration_s=f.duration_s - (now - self.worker_fault_start[i]) if f.duration_s else None,
            )
            for i, f in enumerate(self.schedule)
            if i in self.worker_fault_start
            and f.kind == "slow_rank"
            and f.replica == replica
            and (f.duration_s is None or now - self.worker_fault_start[i] < f.duration_s)
        ]

    async def _inject(self, index: int, f: Fault) -> None:
        fields: dict[str, Any] = {
            "fault": index,
            "fault_kind": f.kind,
            "target": f.target,
            "label": f.label,
            "replica": f.replica,
            "rank": f.rank,
            "link": list(f.link) if f.link else None,
            "step": self.job_step(),
        }
        if f.kind not in SUPERVISOR_KINDS:
            self.worker_fault_start[index] = time.time()
            self.events.emit("fault_injected", applied_by="worker", **fields)
            return
        if f.kind == "coordinator_kill":
            self.events.emit("fault_injected", **fields)
            address = await self.restart_coordinator(f.duration_s or 1.0)
            self.events.emit("coordinator_restarted", address=address, **fields)
            return
        procs = self.procs_of(f.replica or 0)
        if f.rank >= len(procs):
            self.events.emit("fault_skipped", reason="the target is not running", **fields)
            return
        pid = procs[f.rank].pid
        if f.kind == "disk_full":
            pids = injector.limit_file_size(injector.checkpoint_writers(pid), int(f.limit_mb * 1e6))
            self.events.emit("fault_injected", pid=pid, writers=pids, **fields)
            if f.duration_s and pids:
                await asyncio.sleep(f.duration_s)
                injector.limit_file_size(pids, None)
                self.events.emit("fault_cleared", **fields)
            return
        sig = signal.SIGKILL if f.kind == "crash" else signal.SIGSTOP
        self.events.emit("fault_injected", pid=pid, **fields)
        injector.send(pid, sig)
        if f.kind == "hang" and f.duration_s:
            await asyncio.sleep(f.duration_s)
            if injector.send(pid, signal.SIGCONT):
                self.events.emit("fault_cleared", pid=pid, **fields)
