"""What ``unbroken run`` and ``unbroken agent`` both do with the worker processes they start.

The single-machine supervisor (:mod:`unbroken.launch.run.launcher`) and the per-node agent
(:mod:`unbroken.launch.node.agent`) differ in who decides (the supervisor itself, or the coordinator
through the agent's link), not in how a replica's ranks are started, watched, drained on
SIGTERM, ended and cleaned up. Those parts were written twice and a bug in them was fixed
twice; they live here once, in :class:`Supervisor`, and each front end keeps only what differs:
the settings of each rank it starts (:class:`~unbroken.config.WorkerSettings`), and what it
does when a replica finishes (:meth:`Supervisor._replica_finished`) or a rank fails
(:meth:`Supervisor._rank_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from unbroken import config as env
from unbroken.diagnosis import stacks
from unbroken.launch import reaper, workers
from unbroken.launch.policy import RestartBook
from unbroken.launch.workers import ReplicaProcs
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog
from unbroken.train.preemption import EXIT_FLUSH_FAILED, EXIT_PREEMPTED

DEFAULT_TERM_GRACE_S = 25.0  # inside Slurm's default KillWait of 30 s

R = TypeVar("R", bound=ReplicaProcs)
T = TypeVar("T")


class Supervisor(Generic[R]):
    """The worker-process core of a supervisor: its replicas' processes, its guardian
    (:mod:`unbroken.launch.reaper`), SIGTERM's forwarding and drain, and the end of it all.

    Args:
        events: the front end's event log.
        run_dir: the job's run directory (its ranks' stacks are dumped under it).
        command: what each worker runs.
        term_grace_s: on SIGTERM, how long the workers have to finish their step and flush a
            checkpoint before what is left is killed.
    """

    # How a rank that is not running is described in a stack request's answer.
    not_running_here = "here"
    # The whole job runs on this machine: the workers' own sockets are bound to loopback.
    one_machine = False
    book: RestartBook  # the front end's restart policy's record

    def __init__(self, events: EventLog, run_dir: Path, term_grace_s: float, command: tuple[str, ...]) -> None:
        self.events = events
        self.command = command
        self.stack_dir = run_dir
        self.term_grace_s = term_grace_s
        self.replicas: dict[int, R] = {}
        self._guardian: reaper.Guardian | None = None
        self._terminated: float | None = None  # when SIGTERM came (monotonic)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []

    # -- what each front end says ------------------------------------------------------------

    def _on_sigint(self) -> None:
        raise NotImplementedError

    def _on_sigterm(self) -> None:
        raise NotImplementedError

    async def _cleanup(self) -> None:
        raise NotImplementedError

    def _replica_finished(self, r: R) -> None:
        """Every rank of ``r`` exited 0 (its processes are already forgotten)."""
        raise NotImplementedError

    async def _rank_failed(self, r: R, rank: int, proc: asyncio.subprocess.Process, code: int, t_exit: float) -> None:
        """A rank of ``r`` exited with ``code`` != 0 at ``t_exit`` (monotonic) while the
        supervisor was not stopping, its preempted siblings having had their flush."""
        raise NotImplementedError

    # -- running -------------------------------------------------------------------------------

    async def _supervised(self, body: Callable[[], Awaitable[T]]) -> T:
        """Runs ``body`` with SIGINT and SIGTERM handled and the guardian watching, then cleans up."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        try:
            with reaper.supervising() as self._guardian:
                try:
                    return await body()
                finally:
                    await self._cleanup()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _run_task(self, coro: Coroutine[Any, Any, None]) -> None:
        """Runs ``coro`` until it ends or the cleanup cancels it; a finished task is forgotten,
        so a job that restarts for weeks keeps only the tasks still running."""
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    # -- processes -----------------------------------------------------------------------------

    def _worker_environ(self, settings: env.WorkerSettings) -> dict[str, str]:
        """What a worker started with ``settings`` sees (:func:`~unbroken.launch.workers.worker_environ`)."""
        return workers.worker_environ(settings, one_machine=self.one_machine)

    async def _start_process(self, r: R, environ: dict[str, str], log: Path) -> asyncio.subprocess.Process:
        """Starts one worker of ``r`` (the launcher may hand the order to a warm spare instead)."""
        return await workers.start_worker(self.command, environ, log, self._guardian)

    async def _start_rank(
        self,
        r: R,
        settings: env.WorkerSettings,
        log: Path,
        slot: str | None = None,
        resume_step: int | None = None,
    ) -> None:
        """Starts the rank of ``r`` that ``settings`` describe, reports it (``process_started``)
        and watches it until it exits."""
        proc = await self._start_process(r, self._worker_environ(settings), log)
        r.procs.append(proc)
        self.events.emit(
            ev.ProcessStarted(
                replica=r.replica,
                rank=settings.global_rank,
                pid=proc.pid,
                restart=r.restarts,
                node=settings.node,
                slot=slot,
                resume_step=resume_step,
                local_rank=settings.rank if settings.group is not None else None,
            )
        )
        self._run_task(self._watch(r, settings.global_rank, proc))

    async def _watch(self, r: R, rank: int, proc: asyncio.subprocess.Process) -> None:
        """Waits for a rank's exit and sorts it: a sibling this supervisor ended, the replica
        finished, a stop under SIGTERM (the drain reports those), or a failure for the front
        end (:meth:`_rank_failed`), after a preempted rank's siblings had their flush."""
        code = await proc.wait()
        self._exited(proc, code)
        if proc not in r.procs:
            return  # a sibling we ended ourselves
        if code == 0:
            if all(p.returncode == 0 for p in r.procs):
                r.procs = []
                self._replica_finished(r)
            return
        if self._terminated is not None:
            return  # stopping on SIGTERM: _drain_workers reports the exit codes
        t_exit = time.monotonic()
        if code in (EXIT_PREEMPTED, EXIT_FLUSH_FAILED):
            await self._let_siblings_flush(r, proc)
            if proc not in r.procs or self._terminated is not None:
                return
        await self._rank_failed(r, rank, proc, code, t_exit)

    def _exited(self, proc: asyncio.subprocess.Process, code: int) -> None:
        """A worker exited: done (0), whatever it left running (a persist process finishing its
        write) is its own."""
        if code == 0 and self._guardian is not None:
            self._guardian.remove(proc.pid)

    async def _let_siblings_flush(self, r: R, proc: asyncio.subprocess.Process) -> None:
        """``proc`` exited preempted: SIGTERM reached it before (or without) us, as Slurm signals
        every process of a job, so its siblings got it too and are flushing their shards of the
        same step. Killing them now, as for a crash, would lose that step: they get the grace period."""
        siblings = [p.wait() for p in r.procs if p is not proc and p.returncode is None]
        if siblings:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*siblings), self.term_grace_s)

    async def _kill(self, procs: list[asyncio.subprocess.Process]) -> None:
        await workers.kill_groups(procs, self._guardian)

    async def _end(self, r: R) -> None:
        """Ends a replica's processes (and everything in their sessions) here."""
        procs, r.procs = r.procs, []
        await self._kill(procs)

    async def _end_all(self) -> None:
        for r in self.replicas.values():
            await self._end(r)

    async def _stack_of(self, replica: int, rank: int) -> dict[str, Any]:
        """A hung rank's stack, from the process this supervisor started for it (never from a PID
        a connection named)."""
        r = self.replicas.get(replica)
        if r is None or rank >= len(r.procs):
            return {"stack_note": f"replica {replica} rank {rank} is not running {self.not_running_here}"}
        try:
            signum = env.stack_signal()
        except env.ConfigError as e:
            return {"stack_note": str(e)}
        return await stacks.dump(r.procs[rank].pid, stacks.stack_path(self.stack_dir, replica, rank), signum)

    def _credit_progress(self, steps: Mapping[int, int]) -> None:
        """Each replica of ours whose step moved past the one after its processes' start made
        progress: its crash-loop count starts again (:class:`~unbroken.launch.policy.RestartBook`)."""
        for r, step in steps.items():
            if r in self.replicas and step > self.replicas[r].step_at_start + 1:
                self.book.progress(r)

    # -- SIGTERM -------------------------------------------------------------------------------

    def _forward_sigterm(self) -> None:
        workers.forward_sigterm([p for r in self.replicas.values() for p in r.procs])

    def _sigterm_once(self) -> None:
        """SIGTERM: forwarded at once to every worker, which finishes its step, flushes a
        checkpoint and exits (:mod:`unbroken.train.preemption`); :meth:`_drain_workers` waits for
        them. At once, because the ranks of a replica must see it within a step of each other."""
        if self._terminated is None:
            self._terminated = time.monotonic()
            self.events.emit("sigterm_received", grace_s=self.term_grace_s)
            self._forward_sigterm()

    async def _drain_workers(self, event: str) -> None:
        """Waits for the workers told to stop by SIGTERM; what is still running when the grace
        period (counted from the signal) ends is killed by the cleanup. Nothing is restarted.
        ``event`` is reported with their exit codes."""
        assert self._terminated is not None
        self._forward_sigterm()  # to any process started since (a restart under way)
        procs = [p for r in self.replicas.values() for p in r.procs if p.returncode is None]
        left = self._terminated + self.term_grace_s - time.monotonic()
        pending: set[Any] = set()
        if procs:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=max(0.0, left))
        self.events.emit(
            event,
            grace_s=self.term_grace_s,
            exit_codes={r.replica: [p.returncode for p in r.procs] for r in self.replicas.values() if r.procs},
            killed=len(pending),
            drain_s=round(time.monotonic() - self._terminated, 3),
        )
