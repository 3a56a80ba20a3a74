"""``unbroken agent``: one per node of a multi-node job; runs the replicas the coordinator assigns.

The agent keeps one connection to the job's coordinator. The coordinator answers its hello with
the replica ids to run here (``assign``); the agent starts each replica's ranks, restarts them
with the same backoff and limits as ``unbroken run`` (:class:`~unbroken.launch.policy.RestartBook`)
and reports every exit at once (``exited``), so the survivors move on without a timeout. Its
connection is its life: if the agent or its node dies, the coordinator sees the connection
close, evicts all its replicas and hands them to agents with free slots. So that nothing trains
on unwatched, every worker is started with the kernel's parent-death signal and its session is
known to the agent's guardian (see :mod:`unbroken.launch.reaper`): ``kill -9`` of the agent
takes its workers, and whatever they started, with it. If the
coordinator goes away instead, the agent keeps its workers and waits ``--connect-timeout`` for a
coordinator restarted at the same address (on the same state directory), which takes it back
with the replicas it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from unbroken import config as env
from unbroken.control import protocol
from unbroken.launch import reaper, workers
from unbroken.launch.policy import RestartBook, RestartPolicy
from unbroken.observe.events import EventLog

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """What one node's agent runs.

    Attributes:
        command: the worker command line (``python train.py ...``).
        coordinator: the job coordinator's HOST:PORT.
        node: this node's name, unique in the job (the unit of blame and of loss).
        slots: replicas this node can run at once; slots beyond its share are spares.
        ranks_per_replica: processes per replica group (its WORLD_SIZE), all on this node.
        run_dir: logs and this agent's events (``events-<node>.jsonl``).
        policy: restart backoff and limits.
        connect_timeout_s: how long to wait for the coordinator to answer.
        finish_grace_s: once the job is finished, how long a replica still catching up may run.
    """

    command: tuple[str, ...]
    coordinator: str
    node: str = dataclasses.field(default_factory=socket.gethostname)
    slots: int = 1
    ranks_per_replica: int = 1
    run_dir: Path = Path("runs/latest")
    policy: RestartPolicy = RestartPolicy()
    threads_per_rank: int | None = None
    connect_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    finish_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no worker command: put it after `--`, e.g. "
                             "`unbroken agent --coordinator HOST:PORT -- python train.py`")
        env.parse_host_port(self.coordinator, "--coordinator")
        if not self.node or any(c.isspace() for c in self.node):
            raise ValueError(f"--node must be a non-empty name without spaces, got {self.node!r}")
        if self.slots < 1:
            raise ValueError(f"--slots must be >= 1 (replicas this node can run), got {self.slots}")
        if self.ranks_per_replica < 1:
            raise ValueError(f"--ranks-per-replica must be >= 1, got {self.ranks_per_replica}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"--connect-timeout must be > 0, got {self.connect_timeout_s}")


@dataclasses.dataclass
class _Replica(workers.ReplicaProcs):
    done: bool = False  # finished, or given up


class Agent:
    """One node's agent. ``await run()`` returns the exit code: 0 when the job finished."""

    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        (settings.run_dir / "logs").mkdir(exist_ok=True)
        self.events = EventLog(settings.run_dir / f"events-{settings.node}.jsonl", f"agent:{settings.node}")
        self.book = RestartBook(settings.policy)
        self.replicas: dict[int, _Replica] = {}
        self.steps: dict[int, int] = {}
        self.num_replicas = 0
        self.error: str | None = None
        self.exit_code = 1
        self._writer: asyncio.StreamWriter | None = None
        self._job_finished = False
        self._coordinator_lost = False
        self._rejoining: list[int] | None = None  # replicas named in a re-hello not yet answered
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._guardian: reaper.Guardian | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._interrupt)
        try:
            with reaper.supervising() as self._guardian:
                try:
                    reader, self._writer = await self._connect()
                    self._send({"op": "agent_hello", "node": self.s.node, "slots": self.s.slots,
                                "pid": os.getpid()})
                    self.events.emit("agent_started", node=self.s.node, slots=self.s.slots,
                                     coordinator=self.s.coordinator)
                    self._tasks += [asyncio.create_task(self._listen(reader)),
                                    asyncio.create_task(self._heartbeat())]
                    await self._stop.wait()
                finally:
                    await self._cleanup()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if self.error is not None:
            raise ValueError(self.error)
        return self.exit_code

    def _interrupt(self) -> None:
        self.events.emit("agent_interrupted")
        self.exit_code = 130
        self._stop.set()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = env.parse_host_port(self.s.coordinator, "--coordinator")
        deadline = time.monotonic() + self.s.connect_timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port, limit=protocol.MAX_LINE)
                if protocol.connected_to_itself(writer.get_extra_info("socket")):
                    writer.close()
                    raise ConnectionRefusedError("no coordinator yet (connected to itself)")
                return reader, writer
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"no coordinator answered at {self.s.coordinator} within {self.s.connect_timeout_s:g}s "
                        f"({e.strerror or e}): start `unbroken coordinator` there first, or fix --coordinator"
                    ) from e
                await asyncio.sleep(0.2)

    def _send(self, msg: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(protocol.encode(msg))

    async def _heartbeat(self) -> None:
        while True:
            self._send({"op": "agent_heartbeat"})
            await asyncio.sleep(self.s.heartbeat_s)

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        while True:
            # A line over the limit (ValueError from readline) ends the connection: reconnect.
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
                while line := await reader.readline():
                    try:
                        if not await self._handle(protocol.decode(line)):
                            return
                    except (ValueError, TypeError, KeyError) as e:
                        # Skipped: were this task to end, the agent would never hear the coordinator again.
                        log.warning("malformed message from the coordinator skipped (%s): %r", e, line[:80])
            if self._job_finished:
                break
            back = await self._reconnect()
            if back is None:
                break
            reader = back
        # The coordinator is gone for good: no more restarts; the workers notice too and end.
        self._coordinator_lost = True
        self.events.emit("coordinator_lost")
        self._maybe_done()

    async def _handle(self, msg: dict[str, Any]) -> bool:
        """Acts on one message from the coordinator; False when the agent must stop listening."""
        if msg["op"] == "assign":
            ids = msg["replicas"]
            num_replicas = protocol.count(msg, "num_replicas")
            if not isinstance(ids, list) or not all(type(r) is int and 0 <= r < num_replicas for r in ids):
                raise ValueError(f"replicas must be a list of replica ids below {num_replicas}")
            if self._rejoining is not None:
                self.events.emit("coordinator_reconnected", running=self._rejoining, assigned=msg["replicas"])
                self._rejoining = None
            self.num_replicas = int(msg["num_replicas"])
            self.events.emit("replicas_assigned", replicas=msg["replicas"])
            for r in msg["replicas"]:
                await self._spawn(self.replicas.setdefault(int(r), _Replica(int(r))))  # running ones stay
        elif msg["op"] == "agent_status":
            self._progress({int(r): int(s) for r, s in msg["steps"].items()})
        elif msg["op"] == "job_finished":
            self._job_finished = True
            self.events.emit("job_finished")
            self._tasks.append(asyncio.create_task(self._end_after_grace()))
            self._maybe_done()
        elif msg["op"] == "error":
            self.error = f"the coordinator refused this agent: {msg.get('message')}"
            self._stop.set()
            return False
        return True

    async def _reconnect(self) -> asyncio.StreamReader | None:
        """Waits up to ``connect_timeout_s`` for a coordinator at the same address (restarted on
        its state directory) and rejoins it with the replicas this agent runs; None if none came.

        The workers keep training meanwhile and reconnect by themselves, so a coordinator restart
        costs the job no process.
        """
        self.events.emit("coordinator_disconnected")
        if self._writer is not None:
            self._writer.close()
        try:
            reader, self._writer = await self._connect()
        except ConnectionError:
            return None
        running = sorted(r.replica for r in self.replicas.values() if r.procs)
        self._send({"op": "agent_hello", "node": self.s.node, "slots": self.s.slots, "pid": os.getpid(),
                    "running": running})
        # Reported when the coordinator answers: a connect can also reach a dying coordinator's
        # listening socket in the instant before the kernel closes it, and be reset at once.
        self._rejoining = running
        return reader

    def _progress(self, steps: dict[int, int]) -> None:
        if max(steps.values(), default=0) > max(self.steps.values(), default=0):
            self.book.progress()
        for r, step in steps.items():
            self.steps[r] = step
            if r in self.replicas and step > self.replicas[r].step_at_start + 1:
                self.book.progress(r)

    def _threads(self) -> int:
        return self.s.threads_per_rank or max(1, (os.cpu_count() or 1) // (self.s.slots * self.s.ranks_per_replica))

    async def _spawn(self, r: _Replica) -> None:
        if r.procs:
            return
        r.done = False
        r.step_at_start = self.steps.get(r.replica, 0)
        master_port = workers.free_port()
        for rank in range(self.s.ranks_per_replica):
            environ = workers.worker_env(
                coordinator=self.s.coordinator, replica=r.replica, num_replicas=self.num_replicas,
                run_dir=self.s.run_dir, restarts=r.restarts, node=self.s.node, rank=rank,
                world_size=self.s.ranks_per_replica, master_port=master_port, threads=self._threads())
            log = self.s.run_dir / "logs" / f"replica{r.replica}-rank{rank}.log"
            proc = await workers.start_worker(self.s.command, environ, log, self._guardian)
            r.procs.append(proc)
            self.events.emit("process_started", replica=r.replica, rank=rank, pid=proc.pid, restart=r.restarts,
                             node=self.s.node)
            self._tasks.append(asyncio.create_task(self._watch(r, rank, proc)))

    async def _watch(self, r: _Replica, rank: int, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if code == 0 and self._guardian is not None:
            # Done: whatever it left running (a persist process finishing its write) is its own.
            self._guardian.remove(proc.pid)
        if proc not in r.procs:
            return  # a sibling we ended ourselves
        if code == 0:
            if all(p.returncode == 0 for p in r.procs):
                r.procs, r.done = [], True
                self.events.emit("replica_finished", replica=r.replica)
                self._maybe_done()
            return
        self._send({"op": "exited", "replica": r.replica, "exitcode": code})
        decision = self.book.decide(r.replica)
        if self._job_finished or self._coordinator_lost:
            decision = dataclasses.replace(decision, action="stop", reason="the job is over: nothing to rejoin")
        self.events.emit("process_exited", replica=r.replica, rank=rank, pid=proc.pid, exitcode=code,
                         action=decision.action, reason=decision.reason)
        procs, r.procs = r.procs, []
        await workers.kill_groups(procs, self._guardian)
        if decision.action != "restart":
            # This node cannot end the job (the coordinator's quorum decides whether it goes on).
            r.done = True
            self.events.emit("replica_given_up", replica=r.replica, reason=decision.reason)
            self._maybe_done()
            return
        await asyncio.sleep(decision.delay_s)
        if self._stop.is_set() or self._job_finished or self._coordinator_lost:
            r.done = True
            self._maybe_done()
            return
        r.restarts += 1
        self.book.restarted(r.replica)
        self.events.emit("replica_restarting", replica=r.replica, restart=r.restarts)
        await self._spawn(r)

    def _maybe_done(self) -> None:
        """Ends the agent once the job is over and none of its replicas still runs."""
        if not (self._job_finished or self._coordinator_lost):
            return
        if any(r.procs for r in self.replicas.values()):
            return
        finished = self._job_finished or all(r.done for r in self.replicas.values())
        self.exit_code = 0 if finished else 1
        self._stop.set()

    async def _end_after_grace(self) -> None:
        await asyncio.sleep(self.s.finish_grace_s)
        for r in self.replicas.values():
            if r.procs:
                self.events.emit("replica_stopped", replica=r.replica, reason="the job finished without it")
                procs, r.procs = r.procs, []
                await workers.kill_groups(procs, self._guardian)
        self._maybe_done()

    async def _cleanup(self) -> None:
        for t in self._tasks:
            t.cancel()
        for r in self.replicas.values():
            procs, r.procs = r.procs, []
            await workers.kill_groups(procs, self._guardian)
        if self._writer is not None:
            self._writer.close()
        self.events.emit("agent_stopped", exit_code=self.exit_code)
        self.events.close()


def run(settings: AgentSettings) -> int:
    return asyncio.run(Agent(settings).run())
