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

The job's secret (:mod:`unbroken.control.secret_file`) is made here, fresh for every launch,
unless ``--secret-file`` names one; the workers get its path. Everything this process listens
on is bound to loopback (the coordinator, and the TCPStore it hosts): a single-machine job is
reachable from no other machine. A hung rank's stack is fetched here, from the process this
supervisor started (:mod:`unbroken.diagnosis.stacks`), never from a PID a connection named.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken import config as env
from unbroken.checkpoint.disk import CorruptCheckpoint, check_writable, newest_verified_step
from unbroken.checkpoint.history import record_rollback
from unbroken.checkpoint.retention import discard_newer
from unbroken.control import secret_file
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.job_health import DEFAULT_FATAL_EPOCHS, DEFAULT_NO_PROGRESS_S, JobHealth
from unbroken.diagnosis import stacks
from unbroken.diagnosis.metrics import parse_policy
from unbroken.faults import supervisor as injector
from unbroken.faults.schedule import Fault, Schedule
from unbroken.faults.worker import worker_env
from unbroken.launch import reaper, workers
from unbroken.launch.lifecycle import RUNNING, Lifecycle, State, Transition
from unbroken.launch.policy import Placement, RestartBook, RestartPolicy, Slot
from unbroken.launch.verdicts import IGNORE, ISOLATE, ROLLBACK, VERDICT_ACTIONS, verdict_action
from unbroken.launch.workers import free_port, package_path
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog
from unbroken.train.preemption import EXIT_FLUSH_FAILED, EXIT_PREEMPTED

if TYPE_CHECKING:
    from unbroken.observe.http import ObserveServer

HANG_ACTIONS = ("restart", "wait")
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped by SIGTERM after the workers' flush (or the grace period)
DEFAULT_TERM_GRACE_S = 25.0  # inside Slurm's default KillWait of 30 s

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """What ``unbroken run`` starts.

    Attributes:
        command: the worker command line (``python train.py ...``).
        replicas: number of replica groups.
        ranks_per_replica: processes per replica group (its WORLD_SIZE).
        min_replicas: fewest replicas that may train; default a majority.
        run_dir: logs, events and the coordinator's state.
        coordinator: an external coordinator's HOST:PORT; None starts one in-process.
        port: the in-process coordinator's port (0: a free one).
        max_restarts: restarts allowed per replica before it is given up.
        threads_per_rank: torch threads per worker; default splits the cores evenly.
        policy: backoff, limits, crash loop, blame and re-admission (``max_restarts`` wins
            over ``policy.max_restarts_per_replica``).
        spares: spare slots a replica moves to when its node is isolated.
        schedule: faults to inject.
        on_verdict: the strongest action a diagnosis verdict may take on its culprit (see
            :mod:`unbroken.launch.verdicts`): ``isolate`` (its node is isolated and the replica
            moves to a spare, or restarts in place if none is free), ``restart``, or ``ignore``.
        on_hang: a replica evicted for silence while its processes still run is killed and
            restarted (``restart``) or left to resume and rejoin by itself (``wait``).
        warm_spare: keep one worker process with torch already imported for restarts
            (``python script.py`` and ``python -m module`` commands; see launch/warm.py).
        checkpoint_dir: the job's checkpoint directory, handed to the workers; a ``rollback``
            verdict restarts every replica from a checkpoint found there.
        anomaly_policy: what training-metric anomalies do, over the default policy
            (``"nonfinite_loss=rollback"``; see :func:`unbroken.diagnosis.metrics.parse_policy`),
            for the workers (skipping a step) and the coordinator's verdicts.
        term_grace_s: on SIGTERM, how long the workers have to finish their step and flush a
            checkpoint (:mod:`unbroken.train.preemption`) before what is left is killed.
        secret_file: the job's secret; None makes a fresh one in ``run_dir`` (required with an
            external ``coordinator``: the one it was started with).
        http_port: serve ``/metrics`` and the live dashboard on loopback at this port (0: a
            free one); None serves nothing (:mod:`unbroken.observe.http`).
        cross_replica_backend: ``auto``, ``nccl`` or ``gloo`` for the workers; None leaves the
            environment's (:mod:`unbroken.comm.backend`).
        fatal_epochs, no_progress_timeout_s: when the coordinator ends the job instead of
            looping (:mod:`unbroken.control.job_health`).
    """

    command: tuple[str, ...]
    replicas: int
    ranks_per_replica: int = 1
    min_replicas: int | None = None
    run_dir: Path = Path("runs/latest")
    coordinator: str | None = None
    port: int = 0
    max_restarts: int = 10
    threads_per_rank: int | None = None
    heartbeat_timeout_s: float = 2.0
    finish_grace_s: float = 10.0
    policy: RestartPolicy = RestartPolicy()
    spares: int = 0
    schedule: Schedule = Schedule()
    on_verdict: str = "isolate"
    on_hang: str = "restart"
    warm_spare: bool = True
    checkpoint_dir: Path | None = None
    anomaly_policy: str = ""
    term_grace_s: float = DEFAULT_TERM_GRACE_S
    secret_file: Path | None = None
    http_port: int | None = None
    cross_replica_backend: str | None = None
    fatal_epochs: int = DEFAULT_FATAL_EPOCHS
    no_progress_timeout_s: float = DEFAULT_NO_PROGRESS_S

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError(
                "no worker command: put it after `--`, e.g. `unbroken run --replicas 3 -- python train.py`"
            )
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.ranks_per_replica < 1:
            raise ValueError(f"--ranks-per-replica must be >= 1, got {self.ranks_per_replica}")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(
                f"--min-replicas must be between 1 and --replicas ({self.replicas}), got {self.min_replicas}"
            )
        if self.coordinator is not None:
            env.parse_host_ports(self.coordinator, "--coordinator")
            if self.secret_file is None and env.secret_file() is None:
                raise ValueError(
                    f"--coordinator needs the job's secret: --secret-file PATH (or {env.ENV_SECRET_FILE}), "
                    "the file `unbroken coordinator` wrote into its --state-dir"
                )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.spares < 0:
            raise ValueError(f"--spares must be >= 0, got {self.spares}")
        if self.on_verdict not in VERDICT_ACTIONS:
            raise ValueError(f"--on-verdict must be one of {', '.join(VERDICT_ACTIONS)}, got {self.on_verdict!r}")
        if not 0 <= self.term_grace_s < float("inf"):
            raise ValueError(f"--term-grace-s must be 0 or more seconds, got {self.term_grace_s}")
        env.check_seconds({"--heartbeat-timeout": self.heartbeat_timeout_s})  # NaN too, before any replica starts
        if self.on_hang not in HANG_ACTIONS:
            raise ValueError(f"--on-hang must be one of {', '.join(HANG_ACTIONS)}, got {self.on_hang!r}")
        if self.cross_replica_backend is not None and self.cross_replica_backend not in env.CROSS_REPLICA_BACKENDS:
            raise ValueError(
                f"--cross-replica-backend must be one of {', '.join(env.CROSS_REPLICA_BACKENDS)}, "
                f"got {self.cross_replica_backend!r}"
            )
        JobHealth(self.fatal_epochs, self.no_progress_timeout_s)  # the same checks as the coordinator's
        self.schedule.validate(self.replicas, self.ranks_per_replica, coordinator_in_process=self.coordinator is None)
        parse_policy(self.anomaly_policy)  # a typo fails here, with the kinds and actions it accepts
        if self.checkpoint_dir is not None:
            check_writable(str(self.checkpoint_dir))  # before any replica trains, not at its first save

    @property
    def quorum_min(self) -> int:
        return self.min_replicas if self.min_replicas is not None else self.replicas // 2 + 1


def local_slots(replicas: int, spares: int) -> list[Slot]:
    """One machine's slots, each its own fault domain (``local-0`` ...), spares last."""
    return [Slot(f"local-{i}", 0, spare=i >= replicas) for i in range(replicas + spares)]


@dataclasses.dataclass
class _Replica(workers.ReplicaProcs):
    pending: asyncio.Task[None] | None = None
    resume_step: int | None = None  # the checkpoint its next processes load (a rollback)


class Launcher:
    """Runs one job on this machine. ``await run()`` returns the exit code."""

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
        self.events = EventLog(self.run_dir / "events.jsonl", "launcher")
        self.coordinator: Coordinator | None = None
        self.address = ""
        self.http: ObserveServer | None = None
        self.replicas = {r: _Replica(r) for r in range(settings.replicas)}
        policy = dataclasses.replace(settings.policy, max_restarts_per_replica=settings.max_restarts)
        self.book = RestartBook(policy)
        self.placement = Placement(
            local_slots(settings.replicas, settings.spares), settings.replicas, policy, min_replicas=settings.quorum_min
        )
        self.lifecycle = Lifecycle(settings.replicas, time.time())
        self.job_start = time.time()
        self.job_step = 0
        self.exit_code: int | None = None
        self._fired: set[int] = set()
        self._rolling_back: set[int] = set()  # replicas restarted by the last rollback
        self._choosing_rollback = False  # a rollback's target is being verified
        self._discard: asyncio.Task[None] | None = None  # the last rollback's discard of newer steps
        self._terminated: float | None = None  # when SIGTERM came (monotonic)
        self._worker_fault_start: dict[int, float] = {}
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._warm: asyncio.subprocess.Process | None = None
        self._behind_at: dict[int, int] = {}  # replica -> the step it joined behind at
        self.monitor_errors = 0
        self._guardian: reaper.Guardian | None = None

    # -- running ---------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        try:
            with reaper.supervising() as self._guardian:
                try:
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
                    if self._warmable():
                        await self._start_warm()
                    self._tasks.append(asyncio.create_task(self._monitor()))
                    return await self._supervise()
                finally:
                    await self._cleanup()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def stop(self) -> None:
        """Ends the job as Ctrl-C would (benchmarks stop a run once they have what they measure)."""
        self._stop.set()

    async def _start_coordinator(self) -> str:
        if self.s.coordinator is not None:
            return self.s.coordinator
        self.coordinator = Coordinator(self._coordinator_settings(self.s.port), self.secret, self._stack_of)
        self.coordinator.events.subscribe(self._on_coordinator_event)
        await self.coordinator.start()
        return self.coordinator.address

    def _serve_http(self, port: int) -> None:
        """``/metrics`` and the dashboard, from this run directory's events and rows and the
        coordinator's status: asked on this loop when it runs here, over its port when not."""
        from unbroken.observe import http
        from unbroken.observe.live import JobView
        from unbroken.observe.status import fetch_status

        view = JobView(self.run_dir, replicas=self.s.replicas)
        status: http.Status
        if self.s.coordinator is not None:
            address, secret = self.s.coordinator, self.secret

            def status() -> dict[str, Any] | None:
                return _or_none(fetch_status, address, secret)

        else:
            status = http.on_loop(asyncio.get_running_loop(), self._status)
        self.http = http.ObserveServer("127.0.0.1", port, view, status, http.read_token(self.secret.key)).start()
        print(f"unbroken: dashboard {self.http.url} (metrics: /metrics, same token)", file=sys.stderr, flush=True)

    def _status(self) -> dict[str, Any] | None:
        return self.coordinator.status() if self.coordinator is not None else None

    def _coordinator_settings(self, port: int) -> CoordinatorSettings:
        return CoordinatorSettings(
            total_replicas=self.s.replicas,
            min_replicas=self.s.quorum_min,
            state_dir=self.run_dir,
            host="127.0.0.1",
            port=port,
            heartbeat_timeout_s=self.s.heartbeat_timeout_s,
            anomaly_policy=self.s.anomaly_policy,
            fatal_epochs=self.s.fatal_epochs,
            no_progress_timeout_s=self.s.no_progress_timeout_s,
        )

    async def _stack_of(self, replica: int, rank: int) -> dict[str, Any]:
        """A hung rank's stack, from the process this supervisor started for it."""
        r = self.replicas.get(replica)
        if r is None or rank >= len(r.procs):
            return {"stack_note": f"replica {replica} rank {rank} is not running here"}
        try:
            signum = env.stack_signal()
        except env.ConfigError as e:
            return {"stack_note": str(e)}
        return await stacks.dump(r.procs[rank].pid, stacks.stack_path(self.run_dir, replica, rank), signum)

    def _move(self, replica: int, state: State, reason: str) -> None:
        t = self.lifecycle.try_move(replica, state, reason, time.time())
        if t is not None:
            self.events.emit(_state_event(t))
            self._changed.set()

    # -- processes -------------------------------------------------------------------------

    def _worker_env(self, r: _Replica, rank: int, master_port: int, slot: Slot) -> dict[str, str]:
        faults = self.s.schedule.worker_faults(r.replica, rank) if slot == self.placement.home[r.replica] else []
        if r.restarts:  # a one-step fault the job already went through does not strike again
            faults = [f for f in faults if not f.one_step or f.step is None or f.step > self.job_step]
        extra = worker_env(faults, self.job_start)
        if self.s.checkpoint_dir is not None:
            extra[env.ENV_CHECKPOINT_DIR] = str(self.s.checkpoint_dir)
        if r.resume_step is not None:
            extra[env.ENV_RESUME_STEP] = str(r.resume_step)
        if self.s.anomaly_policy:
            extra[env.ENV_ANOMALY_POLICY] = self.s.anomaly_policy
        return workers.worker_env(
            coordinator=self.address,
            replica=r.replica,
            num_replicas=self.s.replicas,
            run_dir=self.run_dir,
            restarts=r.restarts,
            node=slot.node,
            rank=rank,
            world_size=self.s.ranks_per_replica,
            master_port=master_port,
            threads=self._threads(),
            secret_file=self.secret_file,
            extra=extra,
            cross_replica_backend=self.s.cross_replica_backend,
        )

    def _warmable(self) -> bool:
        """``python script.py`` or ``python -m module``, one rank per replica: a warm worker can run it."""
        c = self.s.command
        runnable = len(c) >= 2 and (c[1].endswith(".py") or (c[1] == "-m" and len(c) >= 3))
        return (
            self.s.warm_spare
            and self.s.ranks_per_replica == 1
            and runnable
            and os.path.basename(c[0]).startswith("python")
        )

    async def _start_warm(self) -> None:
        env_ = {
            **os.environ,
            **package_path(),
            "PYTHONUNBUFFERED": "1",
            env.ENV_OMP_NUM_THREADS: env.omp_num_threads(self._threads()),
        }
        self._warm = await asyncio.create_subprocess_exec(
            self.s.command[0],
            "-m",
            "unbroken.launch.warm",
            env=env_,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=workers.die_with_parent(),
        )
        if self._guardian is not None:
            self._guardian.add(self._warm.pid)

    async def _take_warm(self, environ: dict[str, str], log: Path) -> asyncio.subprocess.Process | None:
        warm, self._warm = self._warm, None
        if warm is None or warm.returncode is not None or warm.stdin is None:
            return None
        order = {"env": environ, "argv": list(self.s.command[1:]), "log": str(log)}
        warm.stdin.write((json.dumps(order) + "\n").encode())
        await warm.stdin.drain()
        warm.stdin.close()
        return warm

    def _threads(self) -> int:
        return self.s.threads_per_rank or max(1, (os.cpu_count() or 1) // (self.s.replicas * self.s.ranks_per_replica))

    async def _spawn(self, r: _Replica) -> None:
        slot = self.placement.place(r.replica)
        if slot is None:
            self._move(r.replica, State.ISOLATED, "its node is isolated and no spare slot is free")
            return
        master_port = free_port()
        r.procs = []
        r.step_at_start = self.job_step
        if r.resume_step is not None and self._discard is not None:
            await asyncio.shield(self._discard)  # no process of the rollback starts before it
        for rank in range(self.s.ranks_per_replica):
            path = self.run_dir / "logs" / f"replica{r.replica}-rank{rank}.log"
            environ = self._worker_env(r, rank, master_port, slot)
            proc = await self._take_warm(environ, path) if r.restarts and self._warmable() else None
            if proc is not None:
                self._tasks.append(asyncio.create_task(self._start_warm()))
            else:
                proc = await self._cold_start(environ, path)
            r.procs.append(proc)
            self.events.emit(
                "process_started",
                replica=r.replica,
                rank=rank,
                pid=proc.pid,
                restart=r.restarts,
                node=slot.node,
                slot=slot.name,
                resume_step=r.resume_step,
            )
            asyncio.get_running_loop().create_task(self._watch(r, rank, proc))
        r.resume_step = None  # later restarts catch up from a peer, which is newer

    async def _cold_start(self, environ: dict[str, str], path: Path) -> asyncio.subprocess.Process:
        return await workers.start_worker(self.s.command, environ, path, self._guardian)

    async def _watch(self, r: _Replica, rank: int, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if code == 0 and self._guardian is not None:
            # Done: whatever it left running (a persist process finishing its write) is its own.
            self._guardian.remove(proc.pid)
        if proc not in r.procs:
            return  # a sibling we ended ourselves
        t_exit = time.monotonic()
        if code == 0:
            if all(p.returncode == 0 for p in r.procs):
                r.procs = []
                self._move(r.replica, State.FINISHED, "training finished")
                self.events.emit("replica_finished", replica=r.replica)
                self._changed.set()
            return
        if code in (EXIT_PREEMPTED, EXIT_FLUSH_FAILED) and self._terminated is None:
            # SIGTERM reached this worker before (or without) us, as Slurm signals every process
            # of a job: its siblings got it too and are flushing their shards of the same step.
            # Killing them now, as for a crash, would lose that step; give them the grace period.
            siblings = [p.wait() for p in r.procs if p is not proc and p.returncode is None]
            if siblings:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.gather(*siblings), self.s.term_grace_s)
        if self.lifecycle.state[r.replica] not in RUNNING or self._terminated is not None or proc not in r.procs:
            return
        self._failed(
            r,
            ev.FailureCause.PROCESS_EXIT,
            f"rank {rank} (pid {proc.pid}) exited with code {code}",
            t_exit,
            process_exited={"rank": rank, "pid": proc.pid, "exitcode": code},
        )

    def _failed(
        self,
        r: _Replica,
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
        r: _Replica,
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
        self.book.restarted(r.replica)
        self.events.emit("replica_restarting", replica=r.replica, restart=r.restarts)
        if self.placement.place(r.replica) is not None:
            self._move(r.replica, State.RECOVERING, f"restart {r.restarts} after {delay_s:.2f}s backoff")
        await self._spawn(r)
        self._changed.set()

    # -- what the coordinator and diagnosis say ---------------------------------------------

    def _on_coordinator_event(self, e: ev.Event) -> None:
        if isinstance(e, ev.JobFailed):  # the coordinator ended the job (unbroken.control.job_health)
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
            self._on_verdict(e.to_json())

    def _on_verdict(self, e: dict[str, Any]) -> None:
        """Applies :func:`unbroken.launch.verdicts.verdict_action` to the culprit replica."""
        replica = (e.get("culprit") or {}).get("replica")
        action, why = verdict_action(e, self.s.on_verdict)
        if action == IGNORE or replica not in self.replicas:
            self.events.emit(
                "verdict_ignored",
                verdict_class=e.get("class"),
                replica=replica,
                action=action,
                reason=why if action == IGNORE else "not a replica of this job",
            )
            return
        if action == ROLLBACK:
            self._roll_back(e, why)
            return
        r = self.replicas[replica]
        if self.lifecycle.state[replica] not in RUNNING:
            return
        slot = self.placement.assignment.get(replica)
        if action == ISOLATE and slot is not None and self.placement.free_slots():
            self.placement.isolate(slot.node, time.time())
            self.events.emit(
                "node_isolated", node=slot.node, replica=replica, reason=f"diagnosis verdict: {e.get('class')}"
            )
        self.events.emit("verdict_acted", verdict_class=e.get("class"), replica=replica, action=action, reason=why)
        self._failed(
            r,
            ev.FailureCause.VERDICT,
            f"diagnosis verdict: {e.get('class')} (confidence {e.get('confidence', 0):.2f})",
            time.monotonic(),
            blame=False,
        )

    def _roll_back(self, e: dict[str, Any], why: str) -> None:
        """Restarts every replica from the newest checkpoint before the anomalous step that loads.

        The target is verified (manifests and every checksum, in a thread: it reads the whole
        checkpoint) before anything is stopped or deleted; a damaged one gives way to the next
        older one. The checkpoints newer than the target are deleted once, by
        :meth:`_discard_after`, when every old process is gone and before any new one starts.
        """
        replica = (e.get("culprit") or {}).get("replica")
        anomaly_step = (e.get("evidence") or {}).get("step")

        def ignore(reason: str) -> None:
            self.events.emit(
                "verdict_ignored", verdict_class=e.get("class"), replica=replica, action=ROLLBACK, reason=reason
            )

        if self._choosing_rollback or (
            self._rolling_back and any(self.lifecycle.state[r] != State.TRAINING for r in self._rolling_back)
        ):
            return ignore("a rollback is under way")
        self._rolling_back = set()
        if self.s.checkpoint_dir is None:
            return ignore("no checkpoint directory to roll back to (unbroken run --checkpoint-dir)")
        if not isinstance(anomaly_step, int):
            return ignore("the verdict names no step")
        self._choosing_rollback = True
        self._tasks.append(asyncio.create_task(self._roll_back_to_verified(e, why, replica, anomaly_step, ignore)))

    async def _roll_back_to_verified(
        self, e: dict[str, Any], why: str, replica: Any, anomaly_step: int, ignore: Any
    ) -> None:
        assert self.s.checkpoint_dir is not None
        root = str(self.s.checkpoint_dir)
        try:
            target, skipped = await asyncio.to_thread(newest_verified_step, root, anomaly_step)
        finally:
            self._choosing_rollback = False
        if target is None:
            return ignore(
                f"no loadable checkpoint at or before step {anomaly_step} in {root}"
                + (f" ({'; '.join(skipped)})" if skipped else "")
            )
        if self._stop.is_set():
            return
        try:
            # Before any process stops: from here no tier offers a step of the undone history.
            await asyncio.to_thread(record_rollback, root, target)
        except (OSError, ValueError) as exc:
            return ignore(f"cannot record the rollback to step {target} in {root}: {exc}")
        self.events.emit("verdict_acted", verdict_class=e.get("class"), replica=replica, action=ROLLBACK, reason=why)
        self.events.emit(
            "rollback",
            step=target,
            anomaly_step=anomaly_step,
            culprit=replica,
            anomaly=(e.get("evidence") or {}).get("anomaly"),
            skipped=skipped,
        )
        old: list[asyncio.subprocess.Process] = []
        for r in self.replicas.values():
            if self.lifecycle.state[r.replica] in (State.FINISHED, State.STOPPED, State.ISOLATED):
                continue
            r.resume_step = target
            self._rolling_back.add(r.replica)
            old += r.procs
            if self.lifecycle.state[r.replica] in RUNNING and r.procs:
                self._failed(
                    r,
                    ev.FailureCause.ROLLBACK,
                    f"rollback to the checkpoint of step {target} ({why})",
                    time.monotonic(),
                    blame=False,
                )
        self._discard = asyncio.create_task(self._discard_after(old, root, target))

    async def _discard_after(self, old: list[asyncio.subprocess.Process], root: str, target: int) -> None:
        """Once every old process has ended (none can still be persisting a newer step), deletes
        the checkpoints after ``target``: they hold the history the rollback undid."""
        await asyncio.gather(*(p.wait() for p in old))
        try:
            discarded = await asyncio.to_thread(discard_newer, root, target)
        except (CorruptCheckpoint, OSError, ValueError) as exc:
            # The target broke since it was verified: keep everything; the workers fall back to
            # the next older checkpoint that loads (resume(): never a newer one).
            self.events.emit("checkpoints_kept", rollback_step=target, reason=str(exc))
            return
        if discarded:
            self.events.emit("checkpoints_discarded", steps=discarded, rollback_step=target)

    # -- the periodic work: steps, chaos, re-admission -----------------------------

    async def _monitor(self) -> None:
        """Tracks progress, fires faults, re-admits nodes. One round that raises is logged and
        the next one runs: were this task to end, no progress would count and no node return."""
        while not self._stop.is_set():
            try:
                status = self.coordinator.status() if self.coordinator is not None else None
                if status is not None:
                    self._track_progress(status)
                await self._fire_due_faults()
                await self._readmit()
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
        for r, step in steps.items():
            if r in self.replicas and step > self.replicas[r].step_at_start + 1:
                self.book.progress(r)
            if self.lifecycle.state.get(r) == State.CATCHING_UP and step > self._behind_at.get(r, step) + 1:
                self._move(r, State.TRAINING, f"caught up: trains step {step} as a full member")

    async def _fire_due_faults(self) -> None:
        elapsed = time.time() - self.job_start
        for i, f in enumerate(self.s.schedule):
            if i in self._fired or not f.due(self.job_step, elapsed):
                continue
            self._fired.add(i)
            self._tasks.append(asyncio.create_task(self._inject(i, f)))

    async def _inject(self, index: int, f: Fault) -> None:
        fields: dict[str, Any] = {
            "fault": index,
            "fault_kind": f.kind,
            "target": f.target,
            "label": f.label,
            "replica": f.replica,
            "rank": f.rank,
            "link": list(f.link) if f.link else None,
            "step": self.job_step,
        }
        if f.kind not in ("crash", "hang", "coordinator_kill", "disk_full"):
            self._worker_fault_start[index] = time.time()
            self.events.emit("fault_injected", applied_by="worker", **fields)
            return
        if f.kind == "coordinator_kill":
            await self._kill_coordinator(f, fields)
            return
        r = self.replicas[f.replica or 0]
        if f.rank >= len(r.procs):
            self.events.emit("fault_skipped", reason="the target is not running", **fields)
            return
        pid = r.procs[f.rank].pid
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

    async def _kill_coordinator(self, f: Fault, fields: dict[str, Any]) -> None:
        assert self.coordinator is not None
        port = int(self.address.rpartition(":")[2])
        self.events.emit("fault_injected", **fields)
        await self.coordinator.stop()
        self.coordinator = None
        await asyncio.sleep(f.duration_s or 1.0)
        coordinator = Coordinator(self._coordinator_settings(port), self.secret, self._stack_of)
        coordinator.events.subscribe(self._on_coordinator_event)
        await coordinator.start()
        self.coordinator = coordinator
        self.events.emit("coordinator_restarted", address=coordinator.address, **fields)

    async def _readmit(self) -> None:
        for node in self.placement.due_for_check(time.time()):
            self.placement.isolated[node] = float("inf")  # one check at a time
            self._tasks.append(asyncio.create_task(self._self_check(node)))

    async def _self_check(self, node: str) -> None:
        """Trains a few steps on ``node``'s slot against a peer; a pass re-admits the node."""
        home = next((r for r, s in self.placement.home.items() if s.node == node), None)
        now = time.time()
        still = [
            dataclasses.replace(
                f,
                step=0,
                at_s=None,
                duration_s=f.duration_s - (now - self._worker_fault_start[i]) if f.duration_s else None,
            )
            for i, f in enumerate(self.s.schedule)
            if home is not None
            and i in self._worker_fault_start
            and f.kind == "slow_rank"
            and f.replica == home
            and (f.duration_s is None or now - self._worker_fault_start[i] < f.duration_s)
        ]
        port = free_port()
        base = [sys.executable, "-m", "unbroken.launch.selfcheck", "--port", str(port)]
        extra = {**package_path(), "OMP_NUM_THREADS": "1", env.ENV_SECRET_FILE: str(self.secret_file)}
        procs = []
        for role, fenv in (("checked", worker_env(still, now)), ("reference", {})):
            procs.append(
                await asyncio.create_subprocess_exec(
                    *base,
                    "--role",
                    role,
                    env={**os.environ, **extra, **fenv},
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=workers.die_with_parent(),
                )
            )
            if self._guardian is not None:
                self._guardian.add(procs[-1].pid)
        try:
            waits = [asyncio.ensure_future(p.wait()) for p in procs]
            done, _ = await asyncio.wait(waits, timeout=60)
            passed = len(done) == len(waits) and all(w.result() == 0 for w in waits)
        finally:
            await self._kill(procs)
        self.placement.readmit(node, passed, time.time())
        self.events.emit("self_check", node=node, passed=passed)
        if passed:
            self.events.emit("node_readmitted", node=node)
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
            if first_finish is not None and time.monotonic() - first_finish > self.s.finish_grace_s:
                # Training is over; a replica still catching up has nothing left to join.
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

    def _on_sigterm(self) -> None:
        """SIGTERM: forwarded at once to every worker, which finishes its step, flushes a checkpoint
        and exits (:mod:`unbroken.train.preemption`); :meth:`_drain` waits for them. At once,
        because the ranks of a replica must see it within a step of each other."""
        if self._terminated is None:
            self._terminated = time.monotonic()
            self.events.emit("sigterm_received", grace_s=self.s.term_grace_s)
            self._forward_sigterm()
        self._stop.set()
        self._changed.set()

    def _forward_sigterm(self) -> None:
        workers.forward_sigterm([p for r in self.replicas.values() for p in r.procs])

    async def _drain(self) -> int:
        """Waits for the workers told to stop by :meth:`_on_sigterm`; what is still running when
        the grace period (counted from the signal) ends is killed by the cleanup. No replica is
        restarted."""
        assert self._terminated is not None
        self._forward_sigterm()  # to any process started since (a restart under way)
        procs = [p for r in self.replicas.values() for p in r.procs if p.returncode is None]
        left = self._terminated + self.s.term_grace_s - time.monotonic()
        pending: set[Any] = set()
        if procs:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=max(0.0, left))
        codes = {r.replica: [p.returncode for p in r.procs] for r in self.replicas.values() if r.procs}
        self.events.emit(
            "job_terminated",
            grace_s=self.s.term_grace_s,
            exit_codes=codes,
            killed=len(pending),
            drain_s=round(time.monotonic() - self._terminated, 3),
        )
        return EXIT_TERMINATED

    async def _kill(self, procs: list[asyncio.subprocess.Process]) -> None:
        await workers.kill_groups(procs, self._guardian)

    async def _end(self, r: _Replica) -> None:
        procs, r.procs = r.procs, []
        await self._kill(procs)

    async def _cleanup(self) -> None:
        for t in self._tasks + [r.pending for r in self.replicas.values() if r.pending]:
            t.cancel()
        for r in self.replicas.values():
            await self._end(r)
        if self._warm is not None:
            await self._kill([self._warm])
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


def _or_none(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any] | None:
    try:
        return fn(*args)
    except (OSError, ValueError):
        return None
