"""``unbroken run``: start the coordinator and the replicas, restart the ones that die, clean up.

One asyncio loop runs the coordinator and watches every worker process. A worker's exit is
seen the moment it happens (the loop waits on the process itself), reported to the coordinator
in the same process, so survivors are told to move on before any timeout, and the replica is
restarted. Every worker runs in its own session so that the whole tree it spawned can be ended
by its process-group id; on exit or Ctrl-C nothing this launcher started is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import time
from pathlib import Path

from unbroken import config as env
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.observe.events import EventLog


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

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no worker command: put it after `--`, e.g. `unbroken run --replicas 3 -- python train.py`")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.ranks_per_replica < 1:
            raise ValueError(f"--ranks-per-replica must be >= 1, got {self.ranks_per_replica}")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"--min-replicas must be between 1 and --replicas ({self.replicas}), got {self.min_replicas}")
        if self.coordinator is not None:
            env.parse_host_port(self.coordinator, "--coordinator")

    @property
    def quorum_min(self) -> int:
        return self.min_replicas if self.min_replicas is not None else self.replicas // 2 + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class _Replica:
    replica: int
    procs: list[asyncio.subprocess.Process] = dataclasses.field(default_factory=list)
    restarts: int = 0
    finished: bool = False
    given_up: bool = False


class Launcher:
    """Runs one job on this machine. ``await run()`` returns the exit code."""

    def __init__(self, settings: LaunchSettings) -> None:
        self.s = settings
        self.run_dir = settings.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.events = EventLog(self.run_dir / "events.jsonl", "launcher")
        self.coordinator: Coordinator | None = None
        self.replicas = {r: _Replica(r) for r in range(settings.replicas)}
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            address = await self._start_coordinator()
            for r in self.replicas.values():
                await self._spawn(r, address)
            return await self._supervise(address)
        finally:
            await self._cleanup()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _start_coordinator(self) -> str:
        if self.s.coordinator is not None:
            return self.s.coordinator
        self.coordinator = Coordinator(
            CoordinatorSettings(
                total_replicas=self.s.replicas,
                min_replicas=self.s.quorum_min,
                state_dir=self.run_dir,
                port=self.s.port,
                heartbeat_timeout_s=self.s.heartbeat_timeout_s,
            )
        )
        await self.coordinator.start()
        return self.coordinator.address

    def _worker_env(self, r: _Replica, rank: int, address: str, master_port: int) -> dict[str, str]:
        threads = self.s.threads_per_rank or max(1, (os.cpu_count() or 1) // (self.s.replicas * self.s.ranks_per_replica))
        return {
            **os.environ,
            env.ENV_COORDINATOR: address,
            env.ENV_REPLICA_ID: str(r.replica),
            env.ENV_NUM_REPLICAS: str(self.s.replicas),
            env.ENV_RUN_DIR: str(self.run_dir),
            env.ENV_RESTART_COUNT: str(r.restarts),
            env.ENV_NODE: os.uname().nodename,
            env.ENV_RANK: str(rank),
            env.ENV_LOCAL_RANK: str(rank),
            env.ENV_WORLD_SIZE: str(self.s.ranks_per_replica),
            env.ENV_MASTER_ADDR: "127.0.0.1",
            env.ENV_MASTER_PORT: str(master_port),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a crashing worker leaves its stack in the log
        }

    async def _spawn(self, r: _Replica, address: str) -> None:
        master_port = free_port()
        r.procs = []
        for rank in range(self.s.ranks_per_replica):
            log = open(self.run_dir / "logs" / f"replica{r.replica}-rank{rank}.log", "ab")  # noqa: SIM115
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.s.command,
                    env=self._worker_env(r, rank, address, master_port),
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
            except FileNotFoundError as e:
                raise ValueError(f"cannot start the worker command {self.s.command[0]!r}: {e.strerror}") from e
            finally:
                log.close()
            r.procs.append(proc)
            self.events.emit("process_started", replica=r.replica, rank=rank, pid=proc.pid, restart=r.restarts)
            asyncio.get_running_loop().create_task(self._watch(r, rank, proc))

    async def _watch(self, r: _Replica, rank: int, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if proc not in r.procs or r.given_up:
            return  # a sibling we ended ourselves
        t_exit = time.monotonic()
        if code == 0:
            if all(p.returncode == 0 for p in r.procs):
                r.finished = True
                self.events.emit("replica_finished", replica=r.replica)
                self._changed.set()
            return
        if self.coordinator is not None:
            self.coordinator.replica_exited(r.replica, code)
        self.events.emit(
            "process_exited", replica=r.replica, rank=rank, pid=proc.pid, exitcode=code,
            decision_ms=(time.monotonic() - t_exit) * 1e3,
        )
        await self._end(r)
        if any(x.finished for x in self.replicas.values()):
            r.given_up = True  # the job is over: nothing to rejoin
        elif r.restarts >= self.s.max_restarts:
            r.given_up = True
            self.events.emit("replica_given_up", replica=r.replica, restarts=r.restarts)
        else:
            r.restarts += 1
            self.events.emit("replica_restarting", replica=r.replica, restart=r.restarts)
            await self._spawn(r, self.coordinator.address if self.coordinator else str(self.s.coordinator))
        self._changed.set()

    async def _supervise(self, address: str) -> int:
        first_finish: float | None = None
        while not self._stop.is_set():
            if all(r.finished or r.given_up for r in self.replicas.values()):
                break
            if first_finish is None and any(r.finished for r in self.replicas.values()):
                first_finish = time.monotonic()
            if first_finish is not None and time.monotonic() - first_finish > self.s.finish_grace_s:
                # Training is over; a replica still catching up has nothing left to join.
                for r in self.replicas.values():
                    if not r.finished and not r.given_up:
                        self.events.emit("replica_stopped", replica=r.replica, reason="job finished without it")
                        r.given_up = True
                        await self._end(r)
                break
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.5)
        if self._stop.is_set():
            self.events.emit("job_interrupted")
            return 130
        ok = any(r.finished for r in self.replicas.values())
        self.events.emit("job_finished", ok=ok)
        return 0 if ok else 1

    async def _end(self, r: _Replica) -> None:
        procs, r.procs = r.procs, []
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # anything the worker itself spawned
            await p.wait()

    async def _cleanup(self) -> None:
        for r in self.replicas.values():
            await self._end(r)
        if self.coordinator is not None:
            await self.coordinator.stop()
        self.events.close()


def run(settings: LaunchSettings) -> int:
    return asyncio.run(Launcher(settings).run())
