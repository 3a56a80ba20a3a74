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

The link is authenticated both ways with the job's secret (``--secret-file``, the file
``unbroken coordinator`` keeps in its state directory) and every line is MACed
(:mod:`unbroken.control.protocol`): nobody else can assign it replicas or end the job, and a
line that fails its MAC ends the connection (the agent reconnects). The workers get the
secret's path. A hung rank's stack is dumped here on the coordinator's request, from the
agent's own child, by the PID it started and the path it computes from its own run directory
(:mod:`unbroken.diagnosis.stacks`). SIGTERM (preemption) is forwarded to the workers as
``unbroken run`` does: they finish their step and flush a checkpoint within ``--term-grace-s``;
SIGINT ends them at once.

The agent speaks for its ranks (:mod:`unbroken.launch.node.relay`, off with ``--no-relay``): they
connect to its loopback relay, first in their ``UNBROKEN_COORDINATOR``, and the relay speaks for
them through one node connection, so the coordinator's load is the node count, not the rank count.
With the relay, the agent also hosts a rendezvous store (:class:`~unbroken.wire.store.StoreServer`
at its advertised address): the cross-replica groups whose leader rank runs here meet on it, so
a 100,000-rank job's groups rendezvous on thousands of stores, not all on the coordinator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken import config as env
from unbroken.control import protocol
from unbroken.launch import workers
from unbroken.launch.node.relay import Relay
from unbroken.launch.policy import Decision, RestartBook, RestartPolicy
from unbroken.launch.supervisor_core import Supervisor
from unbroken.observe.events import EventLog
from unbroken.wire.auth import AuthError, JobSecret
from unbroken.wire.store import StoreServer

if TYPE_CHECKING:
    from unbroken.observe.http import ObserveServer

log = logging.getLogger(__name__)

# Heartbeats a coordinator with a standby may leave unanswered before the agent takes it for hung.
COORDINATOR_SILENT_HEARTBEATS = 4


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """What one node's agent runs.

    Attributes:
        command: the worker command line (``python train.py ...``).
        coordinator: the job coordinator's HOST:PORT, or a comma-separated list (the active one and its standbys).
        node: this node's name, unique in the job (the unit of blame and of loss).
        slots: replicas this node can run at once; slots beyond its share are spares.
        ranks_per_replica: processes per replica group (its WORLD_SIZE), all on this node.
        run_dir: logs and this agent's events (``events-<node>.jsonl``).
        policy: restart backoff and limits.
        connect_timeout_s: how long to wait for the coordinator to answer.
        finish_grace_s: once the job is finished, how long a replica still catching up may run.
        secret_file: the job's secret, as the coordinator has it.
        term_grace_s: on SIGTERM, how long the workers have to finish their step and flush a
            checkpoint before what is left is killed.
        nodes_per_replica: nodes each replica group spans (FT-HSDP's shape: a replica sharded
            over hosts); this node then runs ``ranks_per_replica / nodes_per_replica`` of its ranks.
        advertise_addr: the address the group's other nodes reach this one at (its ranks'
            rendezvous binds it when it is group rank 0); None: the address this node uses to
            reach the coordinator.
        relay: speak for this node's ranks through one connection (:mod:`unbroken.launch.node.relay`);
            False (``--no-relay``): each rank connects to the coordinator itself.
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
    secret_file: Path | None = None
    term_grace_s: float = 25.0
    nodes_per_replica: int = 1
    advertise_addr: str | None = None
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    cross_replica_backend: str | None = None
    relay: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.term_grace_s < float("inf"):
            raise ValueError(f"--term-grace-s must be 0 or more seconds, got {self.term_grace_s}")
        if not self.command:
            raise ValueError(
                "no worker command: put it after `--`, e.g. "
                "`unbroken agent --coordinator HOST:PORT -- python train.py`"
            )
        env.parse_host_ports(self.coordinator, "--coordinator")
        if not self.node or any(c.isspace() for c in self.node):
            raise ValueError(f"--node must be a non-empty name without spaces, got {self.node!r}")
        if self.slots < 1:
            raise ValueError(f"--slots must be >= 1 (replicas this node can run), got {self.slots}")
        if self.ranks_per_replica < 1:
            raise ValueError(f"--ranks-per-replica must be >= 1, got {self.ranks_per_replica}")
        if self.nodes_per_replica < 1:
            raise ValueError(f"--nodes-per-replica must be >= 1, got {self.nodes_per_replica}")
        if self.ranks_per_replica % self.nodes_per_replica:
            raise ValueError(
                f"--ranks-per-replica {self.ranks_per_replica} must be a multiple of --nodes-per-replica "
                f"{self.nodes_per_replica}: every node of a replica group runs as many ranks"
            )
        if self.advertise_addr is not None:
            try:
                ipaddress.ip_address(self.advertise_addr)
            except ValueError:
                raise ValueError(f"--advertise-addr must be an IP address, got {self.advertise_addr!r}") from None
        if not 0 < self.connect_timeout_s < float("inf"):  # NaN too
            raise ValueError(f"--connect-timeout must be > 0, got {self.connect_timeout_s}")
        env.check_seconds({"heartbeat_s": self.heartbeat_s})
        env.check_seconds({"finish_grace_s": self.finish_grace_s}, zero_ok=True)
        if self.cross_replica_backend is not None:
            env.CrossReplicaBackend.parse(self.cross_replica_backend, "--cross-replica-backend")
        if self.secret_file is None:
            raise ValueError(
                f"the agent needs the job's secret: --secret-file PATH (or {env.ENV_SECRET_FILE}), "
                "a copy of the `secret` file in the coordinator's --state-dir"
            )


@dataclasses.dataclass
class _Replica(workers.ReplicaProcs):
    done: bool = False  # finished, or given up
    incarnation: int = 0  # of a replica group spanning nodes: the coordinator's start it runs
    failed: Decision | None = None  # the restart policy's word on this node's last exit in that group


class Agent(Supervisor[_Replica]):
    """One node's agent. ``await run()`` returns the exit code: 0 when the job finished."""

    not_running_here = "on this node"

    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        assert settings.secret_file is not None  # AgentSettings refuses none
        self.secret_file = settings.secret_file
        self.secret = JobSecret.load(self.secret_file)
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        (settings.run_dir / "logs").mkdir(exist_ok=True)
        events = EventLog(settings.run_dir / f"events-{settings.node}.jsonl", f"agent:{settings.node}")
        super().__init__(events, settings.run_dir, settings.term_grace_s, settings.command)
        self.book = RestartBook(settings.policy)
        self.steps: dict[int, int] = {}
        self.num_replicas = 0
        self.hot_spares = 0  # of the job: its workers wait for their first quorum without a bound
        self.error: str | None = None
        self.exit_code = 1
        self._link: protocol.Link | None = None
        self.relay: Relay | None = None
        self.store: StoreServer | None = None  # the rendezvous store of the groups led from this node
        self.http: ObserveServer | None = None
        self._job_finished = False
        self._coordinator_lost = False
        self._rejoining: list[int] | None = None  # replicas named in a re-hello not yet answered
        self._address = 0  # which of --coordinator's addresses answered last
        self.term: int | None = None  # the newest lease term a coordinator assigned this agent in
        addresses = env.parse_host_ports(settings.coordinator, "--coordinator")
        self._has_standby = len(addresses) > 1
        self.addr = settings.advertise_addr or env.local_address_towards(addresses[0][0])
        self._ifname = workers.interface_of(self.addr)
        if settings.nodes_per_replica > 1 and self._ifname is None:
            raise ValueError(f"--advertise-addr {self.addr} is not an address of this node")

    async def run(self) -> int:
        await self._supervised(self._run)
        if self.error is not None:
            raise ValueError(self.error)
        return self.exit_code

    async def _run(self) -> None:
        if self.s.http_port is not None:
            self._serve_http()
        self._link = await self._connect()
        if self.s.relay:
            self.store = self._host_store()
            self.relay = Relay(
                self.s.node,
                self.s.coordinator,
                self.secret,
                self._relay_failed,
                store=self.store.address if self.store is not None else "",
            )
            await self.relay.start()
        self._send(self._hello().to_msg())
        self.events.emit(
            "agent_started",
            node=self.s.node,
            slots=self.s.slots,
            coordinator=self.s.coordinator,
            relay=self.relay.address if self.relay is not None else None,
            store=self.store.address if self.store is not None else None,
        )
        self._run_task(self._listen())
        self._run_task(self._heartbeat())
        await self._stop.wait()
        if self._terminated is not None:
            await self._drain_workers("agent_terminated")

    def _host_store(self) -> StoreServer | None:
        """The rendezvous store of the groups led from this node, at its advertised address; None
        if it cannot be bound there (they then meet on the coordinator's store)."""
        try:
            return StoreServer(self.addr, self.secret)
        except OSError as e:
            why = "the groups led from here meet on the coordinator's"
            log.warning("no rendezvous store at %s (%s): %s", self.addr, e, why)
            return None

    def _relay_failed(self, why: str) -> None:
        """The relay stopped (its ranks moved to the coordinator); ranks started from now on go there."""
        self.events.emit("relay_failed", reason=why)

    def _rank_coordinator(self) -> str:
        """What a rank is given as ``UNBROKEN_COORDINATOR``: the relay first, while it serves."""
        if self.relay is None or self.relay.failed is not None:
            return self.s.coordinator
        return f"{self.relay.address},{self.s.coordinator}"

    def _on_sigint(self) -> None:
        self.events.emit("agent_interrupted")
        self.exit_code = 130
        self._stop.set()

    def _on_sigterm(self) -> None:
        """SIGTERM (preemption): forwarded at once to every worker (:meth:`_sigterm_once`), which
        finishes its step, flushes a checkpoint and exits; nothing is restarted."""
        self._sigterm_once()
        self.exit_code = 143
        self._stop.set()

    async def _connect(self) -> protocol.Link:
        addresses = env.parse_host_ports(self.s.coordinator, "--coordinator")
        deadline = time.monotonic() + self.s.connect_timeout_s
        for attempt in itertools.count():
            # The coordinator and its standbys in turn: whichever listens is the active one.
            host, port = addresses[(self._address + attempt) % len(addresses)]
            try:
                reader, writer, session = await protocol.connect_async(host, port, self.secret)
                self._address = (self._address + attempt) % len(addresses)
                return protocol.Link(reader, writer, session)
            except (OSError, asyncio.TimeoutError) as e:
                if isinstance(e, AuthError):
                    log.warning("the coordinator at %s did not authenticate: %s", self.s.coordinator, e)
                if time.monotonic() > deadline:
                    why = str(e) if isinstance(e, AuthError) else (getattr(e, "strerror", None) or repr(e))
                    raise ConnectionError(
                        f"no coordinator answered at {self.s.coordinator} within {self.s.connect_timeout_s:g}s "
                        f"({why}): start `unbroken coordinator` there first, or fix --coordinator"
                        + (" or --secret-file (it must be the coordinator's)" if isinstance(e, AuthError) else "")
                    ) from e
                await asyncio.sleep(0.2 if len(addresses) == 1 else 0.05)
        raise AssertionError("unreachable")

    def _hello(self, running: list[int] | None = None) -> protocol.AgentHello:
        return protocol.AgentHello(
            node=self.s.node,
            slots=self.s.slots,
            running=None if running is None else tuple(running),
            nodes_per_replica=self.s.nodes_per_replica,
            addr=self.addr if self.s.nodes_per_replica > 1 else "",
        )

    def _send(self, msg: dict[str, Any]) -> None:
        if self._link is not None:
            self._link.send(msg)

    async def _heartbeat(self) -> None:
        while True:
            self._send(protocol.AgentHeartbeat().to_msg())
            await asyncio.sleep(self.s.heartbeat_s)

    async def _listen(self) -> None:
        while True:
            # A line over the limit or one that fails its MAC (AuthError, a ConnectionError) ends
            # the connection: reconnect.
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                link = self._link
                assert link is not None
                while line := await self._next_line(link):
                    try:
                        msg = link.decode(line)
                    except ValueError as e:
                        # Skipped: were this task to end, the agent would never hear the coordinator again.
                        log.warning("malformed message from the coordinator skipped (%s): %r", e, line[:80])
                        continue
                    try:
                        if not await self._handle(msg):
                            return
                    except (ValueError, TypeError, KeyError) as e:
                        log.warning("malformed message from the coordinator skipped (%s): %r", e, line[:80])
            if self._job_finished:
                break
            if not await self._reconnect():
                break
        # The coordinator is gone for good: no more restarts; the workers notice too and end.
        self._coordinator_lost = True
        self.events.emit("coordinator_lost")
        self._maybe_done()

    async def _next_line(self, link: protocol.Link) -> bytes | None:
        """The coordinator's next line; b"" (as a closed connection) when a coordinator with a
        standby says nothing past :data:`COORDINATOR_SILENT_HEARTBEATS` heartbeats: it answers
        every heartbeat, so it hangs (SIGSTOP, a stalled disk) and the next address is tried."""
        if not self._has_standby:
            return await link.readline()  # nobody else to try: a hung coordinator is waited for
        silent_s = max(COORDINATOR_SILENT_HEARTBEATS * self.s.heartbeat_s, 2.0)
        try:
            return await asyncio.wait_for(link.readline(), silent_s)
        except asyncio.TimeoutError:
            log.warning("the coordinator said nothing for %.1fs (hung?): trying the next address", silent_s)
            self.events.emit("coordinator_silent", seconds=silent_s)
            self._address += 1  # _connect starts from the next address
            return b""

    async def _handle(self, msg: dict[str, Any]) -> bool:
        """Acts on one message from the coordinator; False when the agent must stop listening."""
        op = msg["op"]
        if op == protocol.Assign.OP:
            assign = protocol.Assign.from_msg(msg)
            if assign.term is not None:
                if self.term is not None and assign.term < self.term:
                    log.warning(
                        "the coordinator at %s holds term %d, older than term %d this agent was assigned by: "
                        "leaving it",
                        self.s.coordinator,
                        assign.term,
                        self.term,
                    )
                    self.events.emit("coordinator_stale", term=assign.term, newest=self.term)
                    self._address += 1  # _connect starts from the next address
                    raise ConnectionError("a coordinator of an older term")
                self.term = assign.term
            if self._rejoining is not None:
                self.events.emit("coordinator_reconnected", running=self._rejoining, assigned=assign.replicas)
                self._rejoining = None
            self.num_replicas, self.hot_spares = assign.num_replicas, assign.hot_spares
            self.events.emit("replicas_assigned", replicas=assign.replicas)
            for r in assign.replicas:
                await self._spawn(self.replicas.setdefault(r, _Replica(r)))  # running ones stay
        elif op == protocol.GroupAssign.OP:
            await self._group_assign(protocol.GroupAssign.from_msg(msg))
        elif op == protocol.GroupStop.OP:
            stopped = self.replicas.get(protocol.GroupStop.from_msg(msg).replica)
            if stopped is not None and stopped.procs:
                self.events.emit("group_stopped", replica=stopped.replica, incarnation=stopped.incarnation)
                await self._end(stopped)
        elif op == protocol.AgentStatus.OP:
            self._progress({int(r): s for r, s in protocol.AgentStatus.from_msg(msg).steps.items()})
        elif op == protocol.DumpStack.OP:
            dump = protocol.DumpStack.from_msg(msg)
            self._run_task(self._dump_stack(dump.replica, dump.rank))
        elif op == protocol.JobFailedNotice.OP:
            notice = protocol.JobFailedNotice.from_msg(msg)
            self.events.emit("job_failed", reason=notice.reason, exit_code=notice.exit_code, cause="coordinator")
            print(f"unbroken agent: the coordinator ended the job: {notice.reason}", file=sys.stderr, flush=True)
            self.exit_code = notice.exit_code
            self._stop.set()
            return False
        elif op == protocol.JobFinished.OP:
            self._job_finished = True
            self.events.emit("job_finished")
            self._run_task(self._end_after_grace())
            self._maybe_done()
        elif op == protocol.Error.OP:
            self.error = f"the coordinator refused this agent: {protocol.Error.from_msg(msg).message}"
            self._stop.set()
            return False
        return True

    async def _group_assign(self, a: protocol.GroupAssign) -> None:
        """Starts this node's ranks of a replica group spanning nodes, as the coordinator says.

        Group rank 0 (``master`` empty) picks the rendezvous port on this node's advertised
        address and tells the coordinator, which passes it to the group's other nodes.
        """
        replica, incarnation, group_rank, nodes = a.replica, a.incarnation, a.group_rank, a.nodes_per_replica
        if nodes != self.s.nodes_per_replica:
            raise ValueError(f"a group_assign for {nodes} nodes per replica, group rank {group_rank}")
        self.num_replicas, self.hot_spares = a.num_replicas, a.hot_spares
        r = self.replicas.setdefault(replica, _Replica(replica))
        if r.procs:  # an older start of the group: ended before the new one begins
            await self._end(r)
        r.incarnation = incarnation
        failed, r.failed = r.failed, None
        if failed is not None and a.blamed:
            # The group failed here first: this node's restart policy applies (its peers' do not).
            if failed.action != "restart":
                r.done = True
                self._send(protocol.GroupRelease(replica=replica).to_msg())
                self.events.emit("replica_given_up", replica=replica, reason=failed.reason)
                return
            r.restarts += 1
            self.book.restarted(replica)
            self.events.emit("replica_restarting", replica=replica, restart=r.restarts, delay_s=failed.delay_s)
            await asyncio.sleep(failed.delay_s)
            if r.incarnation != incarnation or self._stop.is_set():
                return
        if a.master:
            host, port = env.parse_host_port(a.master, "master")
            ipaddress.ip_address(host)
        else:
            host, port = self.addr, workers.free_port(self.addr)
            self._send(protocol.GroupPort(replica=replica, incarnation=incarnation, port=port).to_msg())
        place = env.GroupPlace(group_rank, nodes, host, port, self._ifname)
        self.events.emit(
            "replicas_assigned",
            replicas=[replica],
            group_rank=group_rank,
            incarnation=incarnation,
            master=f"{host}:{port}",
        )
        await self._spawn(r, place)

    async def _dump_stack(self, replica: int, rank: int) -> None:
        """The coordinator's request for a hung rank's stack: dumped from our own child, if it is one."""
        extra = await self._stack_of(replica, rank)
        self.events.emit("stack", replica=replica, rank=rank, **extra)
        report = protocol.StackReport(
            replica, rank, extra.get("process_state") or "", extra.get("stack"), extra.get("stack_note", "")
        )
        self._send(report.to_msg())

    async def _reconnect(self) -> bool:
        """Waits up to ``connect_timeout_s`` for a coordinator at the same address (restarted on
        its state directory) and rejoins it with the replicas this agent runs; None if none came.

        The workers keep training meanwhile and reconnect by themselves, so a coordinator restart
        costs the job no process.
        """
        self.events.emit("coordinator_disconnected")
        if self._link is not None:
            self._link.close()
            self._link = None
        try:
            self._link = await self._connect()
        except ConnectionError:
            return False
        running = sorted(r.replica for r in self.replicas.values() if r.procs)
        self._send(self._hello(running).to_msg())
        # Reported when the coordinator answers: a connect can also reach a dying coordinator's
        # listening socket in the instant before the kernel closes it, and be reset at once.
        self._rejoining = running
        return True

    def _progress(self, steps: dict[int, int]) -> None:
        if max(steps.values(), default=0) > max(self.steps.values(), default=0):
            self.book.progress()
        self.steps.update(steps)
        self._credit_progress(steps)

    def _threads(self) -> int:
        return self.s.threads_per_rank or max(1, (os.cpu_count() or 1) // (self.s.slots * self.s.ranks_per_replica))

    async def _spawn(self, r: _Replica, place: env.GroupPlace | None = None) -> None:
        if r.procs:
            return
        r.done = False
        r.step_at_start = self.steps.get(r.replica, 0)
        master_port = workers.free_port()
        backend = self.s.cross_replica_backend
        for rank in range(self.s.ranks_per_replica // self.s.nodes_per_replica):
            settings = env.WorkerSettings(
                coordinator=self._rank_coordinator(),
                secret_file=self.secret_file,
                replica=r.replica,
                num_replicas=self.num_replicas,
                run_dir=self.s.run_dir,
                restarts=r.restarts,
                node=self.s.node,
                rank=rank,
                world_size=self.s.ranks_per_replica,
                master_port=master_port,
                threads=self._threads(),
                group=place,
                cross_replica_backend=env.CrossReplicaBackend(backend) if backend else None,
                wait_to_join=self.hot_spares > 0,
            )
            # named by the rank in the whole group, across its nodes
            log = self.s.run_dir / "logs" / f"replica{r.replica}-rank{settings.global_rank}.log"
            await self._start_rank(r, settings, log)

    def _replica_finished(self, r: _Replica) -> None:
        r.done = True
        self.events.emit("replica_finished", replica=r.replica)
        self._maybe_done()

    async def _rank_failed(
        self, r: _Replica, rank: int, proc: asyncio.subprocess.Process, code: int, t_exit: float
    ) -> None:
        """Tells the coordinator, then restarts the replica here (its own policy's word), or,
        for a group spanning nodes, leaves the restart to the coordinator."""
        self._send(protocol.Exited(replica=r.replica, exitcode=code, incarnation=r.incarnation).to_msg())
        decision = self.book.decide(r.replica)
        if self._job_finished or self._coordinator_lost:
            decision = dataclasses.replace(decision, action="stop", reason="the job is over: nothing to rejoin")
        if decision.action == "restart" and self.s.nodes_per_replica == 1:
            # Counted when decided, not after the kill and the backoff: a replica failing meanwhile sees it.
            self.book.restarted(r.replica)
        self.events.emit(
            "process_exited",
            replica=r.replica,
            rank=rank,
            pid=proc.pid,
            exitcode=code,
            action=decision.action,
            reason=decision.reason,
        )
        await self._end(r)
        if self.s.nodes_per_replica > 1:
            # The coordinator restarts the whole group; if it blames this node (its report came
            # first), the decision applies when the group starts again (see _group_assign).
            r.failed = decision
            return
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
                await self._end(r)
        self._maybe_done()

    def _serve_http(self) -> None:
        """``/metrics`` and the dashboard for this node's replicas, from its own events and rows."""
        from unbroken.observe import http
        from unbroken.observe.live import JobView

        view = JobView(self.s.run_dir, events_name=f"events-{self.s.node}.jsonl")
        token = http.read_token(self.secret.key)
        self.http = http.ObserveServer(self.s.http_host, self.s.http_port or 0, view, None, token, self.s.node)
        self.http.start()
        print(f"unbroken agent: dashboard {self.http.url} (metrics: /metrics, same token)", file=sys.stderr, flush=True)

    async def _cleanup(self) -> None:
        if self.http is not None:
            self.http.close()
        for t in self._tasks:
            t.cancel()
        await self._end_all()
        if self.relay is not None:
            self.relay.close()
        served = None
        if self.store is not None:
            self.store.close()
            served = self.store.served
        if self._link is not None:
            self._link.close()
        self.events.emit("agent_stopped", exit_code=self.exit_code, store_requests=served)
        self.events.close()


def run(settings: AgentSettings) -> int:
    os.umask(0o077)  # the run's directory, logs, events, metrics and checkpoints: 0700/0600, workers' too
    return asyncio.run(Agent(settings).run())
