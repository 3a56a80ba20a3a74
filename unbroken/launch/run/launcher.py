"""``unbroken run``: the supervisor that starts, watches, restarts, isolates and reports.

One asyncio loop runs the coordinator and watches every worker process. A worker's exit is
seen the moment it happens (the loop waits on the process itself); the restart decision is
taken in the same callback, before anything else is awaited, and reported to the coordinator
in the same process, so survivors move on before any timeout. The decision itself is the pure
policy of :mod:`unbroken.launch.policy`; the replica's state follows
:mod:`unbroken.launch.lifecycle`, and every transition is an event.

The supervisor also listens to the coordinator's events: an eviction of a replica whose
processes still run is a hang (the processes are killed and the replica restarted), and a
``verdict`` from diagnosis names a culprit to restart or isolate (``on_verdict``). Every worker
runs in its own session so that the whole tree it spawned can be ended by its process-group id;
on exit or Ctrl-C nothing this launcher started is left running. SIGTERM (preemption) is
forwarded instead: the workers finish their step and flush a checkpoint within
``--term-grace-s`` (:mod:`unbroken.train.preemption`), and nothing is restarted.

The job's secret (:mod:`unbroken.control.state.secret_file`) is made here, fresh for every launch,
unless ``--secret-file`` names one; the workers get its path. Everything this process listens
on is bound to loopback (the coordinator, and the TCPStore it hosts): a single-machine job is
reachable from no other machine. A hung rank's stack is fetched here, from the process this
supervisor started (:mod:`unbroken.diagnosis.stacks`), never from a PID a connection named.

The parts with state of their own are modules of their own, given what they act on:
:mod:`~unbroken.launch.recovery.rollback`, :mod:`~unbroken.launch.recovery.fault_firing`,
:mod:`~unbroken.launch.recovery.readmission`, :mod:`~unbroken.launch.run.warm_spare`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken import config as env
from unbroken.control.coordinator import Coordinator
from unbroken.control.state import secret_file
from unbroken.faults.worker_chaos import chaos_env
from unbroken.launch.lifecycle import RUNNING, Lifecycle, State, Transition
from unbroken.launch.policy import Placement, RestartBook, Slot
from unbroken.launch.recovery.fault_firing import FaultFiring
from unbroken.launch.recovery.readmission import Readmission
from unbroken.launch.recovery.rollback import Rollback
from unbroken.launch.recovery.verdicts import IGNORE, ISOLATE, ROLLBACK, culprit_replica, verdict_action
from unbroken.launch.run import dashboard, torchft_compat
from unbroken.launch.run.settings import LaunchSettings, local_slots
from unbroken.launch.run.warm_spare import WarmSpare
from unbroken.launch.supervisor_core import Supervisor
from unbroken.launch.workers import SupervisedReplica, free_port
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog

if TYPE_CHECKING:
    from unbroken.observe.http import ObserveServer

# The longest a used warm spare waits for its replica to rejoin before the next one is warmed.
REWARM_AFTER_S = 10.0
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped by SIGTERM after the workers' flush (or the grace period)

log = logging.getLogger(__name__)


class Launcher(Supervisor[SupervisedReplica]):
    """Runs one job on this machine. ``await run()`` returns the exit code."""

    one_machine = True

    def __init__(self, settings: LaunchSettings) -> None:
        self.s = settings
        self.run_dir = settings.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if settings.secret_file is not None or settings.coordinator is not None:
            found = secret_file.given(settings.secret_file)
            assert found is not None  # LaunchSettings checked it
            self.secret, self.secret_file = found
        else:
            self.secret, self.secret_file = secret_file.fresh(self.run_dir)
        super().__init__(
            EventLog(self.run_dir / "events.jsonl", "launcher"), self.run_dir, settings.term_grace_s, settings.command
        )
        self.coordinator: Coordinator | None = None
        self.address = ""
        self.http: ObserveServer | None = None
        self.replicas = {r: SupervisedReplica(r) for r in range(settings.processes)}
        policy = dataclasses.replace(settings.policy, max_restarts_per_replica=settings.max_restarts)
        self.book = RestartBook(policy)
        self.placement = Placement(
            local_slots(settings.processes, settings.spares),
            settings.processes,
            policy,
            min_replicas=settings.quorum_min,
        )
        self.lifecycle = Lifecycle(settings.processes, time.time())
        self.job_start = time.time()
        self.job_step = 0
        self.exit_code: int | None = None
        self._changed = asyncio.Event()
        self._behind_at: dict[int, int] = {}  # replica -> the step it joined behind at
        self._members: frozenset[int] = frozenset()  # of the newest quorum
        self.monitor_errors = 0
        self.warm = WarmSpare(
            settings.command, settings.warm_spare, settings.ranks_per_replica, self.s.threads(), lambda: self._guardian
        )
        self.rollback = Rollback(
            settings.checkpoint_dir,
            self.events,
            self.replicas,
            self.lifecycle,
            self._fail_for_rollback,
            self._stop.is_set,
            self._run_task,
        )
        self.faults = FaultFiring(
            settings.schedule,
            self.events,
            lambda replica: self.replicas[replica].procs,
            lambda: self.job_step,
            self._restart_coordinator,
            self._run_task,
        )
        self.readmission = Readmission(
            self.placement,
            self.events,
            self.secret_file,
            self.faults.slow_faults_on,
            lambda: self._guardian,
            self._readmitted,
            self._run_task,
        )

    # -- running ---------------------------------------------------------------------------

    async def run(self) -> int:
        return await self._supervised(self._run)

    async def _run(self) -> int:
        self.address = await self._start_coordinator()
        if self.s.http_port is not None:
            self._serve_http(self.s.http_port)
        self.job_start = time.time()
        self.events.emit(
            ev.JobStarted(
                replicas=self.s.replicas,
                spares=self.s.spares,
                schedule=self.s.schedule.to_json(),
                coordinator=self.address,
            )
        )
        for r in self.replicas.values():
            await self._spawn(r)
        if self.warm.usable():
            await self.warm.start()
        self._run_task(self._monitor())
        return await self._supervise()

    def _on_sigint(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Ends the job as Ctrl-C would (benchmarks stop a run once they have what they measure)."""
        self._stop.set()

    async def _start_coordinator(self) -> str:
        if self.s.coordinator is not None:
            return self.s.coordinator
        self.coordinator = Coordinator(self.s.coordinator_settings(self.s.port), self.secret, self._stack_of)
        self.coordinator.events.subscribe(self._on_coordinator_event)
        await self.coordinator.start()
        return self.coordinator.address

    def _serve_http(self, port: int) -> None:
        s = self.s
        self.http = dashboard.serve(self.run_dir, s.replicas, port, self.secret, s.coordinator, self._status)
        print(f"unbroken: dashboard {self.http.url} (metrics: /metrics, same token)", file=sys.stderr, flush=True)

    def _status(self) -> dict[str, Any] | None:
        return self.coordinator.status() if self.coordinator is not None else None

    def _move(self, replica: int, state: State, reason: str) -> None:
        t = self.lifecycle.try_move(replica, state, reason, time.time())
        if t is not None:
            self.events.emit(_state_event(t))
            self._changed.set()

    # -- processes -------------------------------------------------------------------------

    def _worker_settings(self, r: SupervisedReplica, rank: int, master_port: int, slot: Slot) -> env.WorkerSettings:
        faults = self.s.schedule.worker_faults(r.replica, rank) if slot == self.placement.home[r.replica] else []
        if r.restarts:  # a one-step fault the job already went through does not strike again
            faults = [f for f in faults if not f.one_step or f.step is None or f.step > self.job_step]
        backend = self.s.cross_replica_backend
        return env.WorkerSettings(
            coordinator=self.address,
            secret_file=self.secret_file,
            replica=r.replica,
            num_replicas=self.s.replicas,
            run_dir=self.run_dir,
            restarts=r.restarts,
            node=slot.node,
            rank=rank,
            world_size=self.s.ranks_per_replica,
            master_port=master_port,
            threads=self.s.threads(),
            cross_replica_backend=env.CrossReplicaBackend(backend) if backend else None,
            checkpoint_dir=self.s.checkpoint_dir,
            resume_step=r.resume_step,
            anomaly_policy=self.s.anomaly_policy,
            # `import torchft` is unbroken's facade
            python_path=(
                torchft_compat.python_path_with(torchft_compat.write_shim(self.run_dir))
                if self.s.torchft_compat
                else None
            ),
            chaos=chaos_env(faults, self.job_start).get(env.ENV_CHAOS),
            wait_to_join=self.s.hot_spares > 0,
            replica_groups=self.s.replicas + self.s.hot_spares,
        )

    async def _spawn(self, r: SupervisedReplica) -> None:
        slot = self.placement.place(r.replica)
        if slot is None:
            self._move(r.replica, State.ISOLATED, "its node is isolated and no spare slot is free")
            return
        master_port = free_port()
        r.procs = []
        r.step_at_start = self.job_step
        if r.resume_step is not None:
            await self.rollback.ready()  # no process of the rollback starts before its discard
        for rank in range(self.s.ranks_per_replica):
            await self._start_rank(
                r,
                self._worker_settings(r, rank, master_port, slot),
                self.run_dir / "logs" / f"replica{r.replica}-rank{rank}.log",
                slot=slot.name,
                resume_step=r.resume_step,
            )
        r.resume_step = None  # later restarts catch up from a peer, which is newer

    async def _start_process(
        self, r: SupervisedReplica, environ: dict[str, str], log: Path
    ) -> asyncio.subprocess.Process:
        """A restarted replica's rank goes to the warm spare when one is ready (another is
        warmed once it has rejoined); everything else starts cold."""
        proc = await self.warm.take(environ, log) if r.restarts and self.warm.usable() else None
        if proc is None:
            return await super()._start_process(r, environ, log)
        self._run_task(self._rewarm_after(r.replica))
        return proc

    async def _rewarm_after(self, replica: int) -> None:
        """Warms the next spare once ``replica`` trains again (or after ``REWARM_AFTER_S``): an
        interpreter importing torch beside the rejoin took the CPU the catch-up and the survivors'
        steps needed (on 2 cores their steps after a rejoin were 0.10 to 0.14 s against 0.085 s)."""
        deadline = time.monotonic() + REWARM_AFTER_S
        while time.monotonic() < deadline and not self._stop.is_set():
            if self.lifecycle.state.get(replica) in (State.TRAINING, State.FINISHED, State.STOPPED):
                break
            await asyncio.sleep(0.1)
        if not self._stop.is_set():
            await self.warm.start()

    def _replica_finished(self, r: SupervisedReplica) -> None:
        self._move(r.replica, State.FINISHED, "training finished")
        self.events.emit("replica_finished", replica=r.replica)
        self._changed.set()

    async def _rank_failed(
        self, r: SupervisedReplica, rank: int, proc: asyncio.subprocess.Process, code: int, t_exit: float
    ) -> None:
        if self.lifecycle.state[r.replica] not in RUNNING:
            return  # already failed (a sibling's exit, an eviction) or given up
        self._failed(
            r,
            ev.FailureCause.PROCESS_EXIT,
            f"rank {rank} (pid {proc.pid}) exited with code {code}",
            t_exit,
            process_exited={"rank": rank, "pid": proc.pid, "exitcode": code},
        )

    def _failed(
        self,
        r: SupervisedReplica,
        failure: ev.FailureCause,
        reason: str,
        t_detect: float,
        blame: bool = True,
        process_exited: dict[str, Any] | None = None,
    ) -> None:
        """Decides at once what to do about a failed replica; the slow parts run afterwards."""
        self._move(r.replica, State.FAILED, reason)
        if self.coordinator is not None:
            self.coordinator.replica_exited(r.replica, (process_exited or {}).get("exitcode"))
        slot = self.placement.assignment.get(r.replica)
        isolated_now = blame and slot is not None and self.placement.blame(slot.node, time.time())
        decision = self.book.decide(r.replica)
        if any(self.lifecycle.state[x] == State.FINISHED for x in self.lifecycle.state):
            decision = dataclasses.replace(decision, action="stop", reason="the job finished: nothing to rejoin")
        if decision.action == "restart":
            # Counted when decided, not after the backoff: two replicas failing within it were
            # both restarted past the crash-loop limit.
            self.book.restarted(r.replica)
        decision_ms = (time.monotonic() - t_detect) * 1e3
        if process_exited is not None:
            self.events.emit(
                "process_exited", replica=r.replica, **process_exited, decision_ms=decision_ms, action=decision.action
            )
        self.events.emit(
            "restart_decision",
            replica=r.replica,
            action=decision.action,
            delay_s=decision.delay_s,
            reason=decision.reason,
            cause=reason,
            decision_ms=decision_ms,
            failure=failure,
        )
        if isolated_now and slot is not None:
            self.events.emit(
                "node_isolated",
                node=slot.node,
                reason=f"{self.s.policy.blame_threshold} faults " f"within {self.s.policy.blame_window_s:g}s",
                replica=r.replica,
            )
        procs, r.procs = r.procs, []
        r.pending = asyncio.get_running_loop().create_task(
            self._act(r, decision.action, decision.delay_s, decision.reason, decision.exit_code, procs)
        )

    async def _act(
        self,
        r: SupervisedReplica,
        action: str,
        delay_s: float,
        reason: str,
        exit_code: int,
        procs: list[asyncio.subprocess.Process],
    ) -> None:
        await self._kill(procs)
        if action == "end_job":
            self.events.emit("job_failed", reason=reason, exit_code=exit_code)
            print(f"unbroken: {reason}", file=sys.stderr)
            self.exit_code = exit_code
            self._stop.set()
            return
        if action == "stop":
            self._move(r.replica, State.STOPPED, reason)
            self.events.emit("replica_given_up", replica=r.replica, restarts=r.restarts, reason=reason)
            self._changed.set()
            return
        await asyncio.sleep(delay_s)
        if self._stop.is_set():
            return
        r.restarts += 1
        self.events.emit("replica_restarting", replica=r.replica, restart=r.restarts)
        if self.placement.place(r.replica) is not None:
            self._move(r.replica, State.RECOVERING, f"restart {r.restarts} after {delay_s:.2f}s backoff")
        await self._spawn(r)
        self._changed.set()

    # -- what the coordinator and diagnosis say ---------------------------------------------

    def _on_coordinator_event(self, e: ev.Event) -> None:
        if isinstance(e, ev.JobFailed):  # the coordinator ended the job (unbroken.control.quorum.job_health)
            if self.exit_code is None:
                print(f"unbroken: the job is stopped: {e.reason}", file=sys.stderr, flush=True)
                if e.error:
                    print(f"unbroken: the error: {e.error[:500]}", file=sys.stderr, flush=True)
                self.exit_code = e.exit_code
                self._stop.set()
                self._changed.set()
        elif isinstance(e, ev.ReplicaConnected) and e.replica in self.replicas:
            self._move(e.replica, State.WARMING_UP, "connected to the coordinator")
        elif isinstance(e, ev.Quorum):
            self._members = frozenset(e.members)
            self._behind_at.update({r: e.step for r in e.behind})
            for t in self.lifecycle.on_quorum(e.members, e.behind, time.time()):
                self.events.emit(_state_event(t))
        elif isinstance(e, ev.ReplicaEvicted) and e.replica in self.replicas:
            r = self.replicas[e.replica]
            if (
                e.cause == ev.EvictCause.NO_HEARTBEAT  # not a closed connection: that is an exit
                and self.s.on_hang == "restart"
                and r.procs
                and all(p.returncode is None for p in r.procs)
                and self.lifecycle.state[r.replica] in RUNNING
            ):
                # Its processes run but it stopped answering: a hang. Kill it, restart it.
                self._failed(r, ev.FailureCause.HANG, f"hang: {e.reason}", time.monotonic())
        elif isinstance(e, ev.Verdict):
            self._on_verdict(e)

    def _on_verdict(self, e: ev.Verdict) -> None:
        """Applies :func:`unbroken.launch.recovery.verdicts.verdict_action` to the culprit replica."""
        replica = culprit_replica(e)
        action, why = verdict_action(e, self.s.on_verdict, spare_free=bool(self.placement.free_slots()))
        ignored = why if action == IGNORE else None
        if ignored is None and replica not in self.replicas:
            ignored = "not a replica of this job"
        if ignored is None and self._terminated is not None:  # its replicas flush and go quiet
            ignored = "the job is ending (SIGTERM)"
        if ignored is not None:
            self.events.emit(
                "verdict_ignored", verdict_class=e.verdict_class, replica=replica, action=action, reason=ignored
            )
            return
        if action == ROLLBACK:
            self.rollback.start(e, why)
            return
        r = self.replicas[replica]
        if self.lifecycle.state[replica] not in RUNNING:
            return
        slot = self.placement.assignment.get(replica)
        if action == ISOLATE and slot is not None and self.placement.free_slots():
            self.placement.isolate(slot.node, time.time())
            self.events.emit(
                "node_isolated", node=slot.node, replica=replica, reason=f"diagnosis verdict: {e.verdict_class}"
            )
        self.events.emit("verdict_acted", verdict_class=e.verdict_class, replica=replica, action=action, reason=why)
        self._failed(
            r,
            ev.FailureCause.VERDICT,
            f"diagnosis verdict: {e.verdict_class} (confidence {e.confidence:.2f})",
            time.monotonic(),
            blame=False,
        )

    def _fail_for_rollback(self, r: SupervisedReplica, reason: str) -> None:
        self._failed(r, ev.FailureCause.ROLLBACK, reason, time.monotonic(), blame=False)

    # -- the periodic work: steps, chaos, re-admission -----------------------------

    async def _monitor(self) -> None:
        """Tracks progress, fires faults, re-admits nodes. One round that raises is logged and
        the next one runs: were this task to end, no progress would count and no node return."""
        while not self._stop.is_set():
            try:
                status = self.coordinator.status() if self.coordinator is not None else None
                if status is not None:
                    self._track_progress(status)
                self.faults.fire_due(self.job_step, time.time() - self.job_start)
                self.readmission.check_due(time.time())
            except Exception:
                self.monitor_errors += 1
                if self.monitor_errors & (self.monitor_errors - 1) == 0:  # 1st, 2nd, 4th...: not a flood
                    log.exception(
                        "supervisor monitor round failed (%d so far); the next one runs all the same",
                        self.monitor_errors,
                    )
            await asyncio.sleep(0.05)

    def _track_progress(self, status: dict[str, Any]) -> None:
        steps = {r: v["step"] for r, v in status["replicas"].items()}
        top = max(steps.values(), default=0)
        if top > self.job_step:
            self.job_step = top
            self.book.progress()
        self._credit_progress(steps)
        for r, step in steps.items():
            if self.lifecycle.state.get(r) == State.CATCHING_UP and step > self._behind_at.get(r, step) + 1:
                self._move(r, State.TRAINING, f"caught up: trains step {step} as a full member")

    async def _restart_coordinator(self, down_s: float) -> str:
        """A ``coordinator_kill`` fault: stops the coordinator abruptly, and after ``down_s``
        starts a fresh one on the same port and state directory; returns its address."""
        assert self.coordinator is not None
        port = int(self.address.rpartition(":")[2])
        await self.coordinator.stop()
        self.coordinator = None
        await asyncio.sleep(down_s)
        coordinator = Coordinator(self.s.coordinator_settings(port), self.secret, self._stack_of)
        coordinator.events.subscribe(self._on_coordinator_event)
        await coordinator.start()
        self.coordinator = coordinator
        return coordinator.address

    async def _readmitted(self, node: str) -> None:
        """``node`` passed its self-check: the replicas parked for want of a slot start again."""
        for r in self.replicas.values():
            if self.lifecycle.state[r.replica] == State.ISOLATED:
                self._move(r.replica, State.RECOVERING, f"a slot is free again on {node}")
                await self._spawn(r)

    # -- the end ---------------------------------------------------------------------------

    async def _supervise(self) -> int:
        first_finish: float | None = None
        states = self.lifecycle.state
        while not self._stop.is_set():
            if all(s in (State.FINISHED, State.STOPPED) for s in states.values()):
                break
            if first_finish is None and State.FINISHED in states.values():
                first_finish = time.monotonic()
            over = first_finish is not None and time.monotonic() - first_finish > self.s.finish_grace_s
            if first_finish is not None and (over or self._members_finished()):
                # Training is over; a replica still catching up, or waiting as a spare, has
                # nothing left to join.
                for r in self.replicas.values():
                    if states[r.replica] not in (State.FINISHED, State.STOPPED):
                        self.events.emit("replica_stopped", replica=r.replica, reason="job finished without it")
                        await self._end(r)
                        self._move(r.replica, State.FAILED, "the job finished without it")
                        self._move(r.replica, State.STOPPED, "the job finished without it")
                break
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.5)
        if self.exit_code is not None:
            return self.exit_code
        if self._terminated is not None:
            return await self._drain()
        if self._stop.is_set():
            self.events.emit("job_interrupted")
            return 130
        ok = State.FINISHED in states.values()
        self.events.emit("job_finished", ok=ok)
        return 0 if ok else 1

    def _members_finished(self) -> bool:
        """Every member of the newest quorum finished: who is left (a spare, a restart waiting
        to join) was in no epoch that trains on, and has no donor left to catch up from."""
        states = self.lifecycle.state
        return bool(self._members) and all(states.get(m) in (State.FINISHED, State.STOPPED) for m in self._members)

    def _on_sigterm(self) -> None:
        """SIGTERM: forwarded at once to every worker (:meth:`_sigterm_once`); :meth:`_drain`
        waits for them."""
        self._sigterm_once()
        self._stop.set()
        self._changed.set()

    async def _drain(self) -> int:
        """Waits for the workers told to stop by :meth:`_on_sigterm`; no replica is restarted."""
        await self._drain_workers("job_terminated")
        return EXIT_TERMINATED

    async def _cleanup(self) -> None:
        for t in self._tasks + [r.pending for r in self.replicas.values() if r.pending]:
            t.cancel()
        await self._end_all()
        await self.warm.close()
        if self.http is not None:
            self.http.close()
        if self.coordinator is not None:
            await self.coordinator.stop()
        self.events.close()


def run(settings: LaunchSettings) -> int:
    os.umask(0o077)  # the run's directory, logs, events, metrics and checkpoints: 0700/0600, workers' too
    return asyncio.run(Launcher(settings).run())


def _state_event(t: Transition) -> ev.ReplicaState:
    return ev.ReplicaState(replica=t.replica, old=t.old.value, new=t.new.value, reason=t.reason)
