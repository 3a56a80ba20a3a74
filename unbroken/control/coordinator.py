"""The coordinator service: membership, quorum epochs, pushed aborts, persisted history.

A thin asyncio shell around :mod:`unbroken.control.quorum`. Each rank of each replica keeps one
TCP connection open (see :mod:`unbroken.control.protocol`); a closed connection or a process
exit reported by the supervisor evicts the replica at once, a silent one is evicted when its
heartbeats stop. The coordinator also hosts the ``torch.distributed`` TCPStore on which the
cross-replica groups of every epoch rendezvous.

Threat model: anyone who can reach the port. Nothing is read from a connection before it proves
it holds the job's secret (:mod:`unbroken.wire.auth`), and every line after that carries a MAC;
a peer that fails either is dropped, logged, and changes nothing. Beyond the key, nothing a
member says is trusted further than it must be: fields are validated (ids below the job's
counts, bounded times, steps that do not go back), a connection speaks only for the replica and
rank it said hello as, a live replica's slot cannot be taken over, no PID or path is taken
from the network (a hung rank's stack comes from its owner, see :mod:`unbroken.diagnosis.stacks`),
and connections, their buffers and every map are bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import statistics
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from unbroken.config import anomaly_policy, check_seconds
from unbroken.control import protocol
from unbroken.control.assignment import Assignment
from unbroken.control.event_loop import listen_backlog
from unbroken.control.failure import classify
from unbroken.control.groups import MAX_NODES_PER_REPLICA, GroupLaunch, advertised_address
from unbroken.control.heartbeat import HeartbeatPlan, plan_heartbeats
from unbroken.control.job_health import DEFAULT_FATAL_EPOCHS, DEFAULT_NO_PROGRESS_S, JobHealth, JobStop
from unbroken.control.quorum import QuorumDecision, QuorumRequest, QuorumRules, QuorumState
from unbroken.control.setaside import SetAside
from unbroken.control.state_store import KEEP_EVENTS, StateStore
from unbroken.diagnosis.master import DiagnosisMaster
from unbroken.diagnosis.metrics import parse_policy
from unbroken.diagnosis.service import DiagnosisService, StackSource
from unbroken.diagnosis.telemetry import TelemetryBatch
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog
from unbroken.wire.admission import Admission, RefusalLog
from unbroken.wire.auth import TICKET_BYTES, AuthError, JobSecret, server_handshake_async

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    """How the coordinator runs.

    Attributes:
        total_replicas: replicas the job is configured with.
        min_replicas: fewest replicas that may train.
        state_dir: where epochs and events persist (SQLite) and events.jsonl is written.
        host: address to bind; loopback unless the job spans machines.
        port: port to bind; 0 picks a free one.
        heartbeat_timeout_s: a replica silent this long is evicted (a stopped process).
        suspect_after_s: a replica silent this long is not waited for when a new epoch forms
            (five missed heartbeats); it stays alive, and counted, until the timeout above.
        join_window_floor_s: the join window never drops below this; above it the window is
            three median step times, learned from what replicas report.
        startup_window_s: how long the first quorum waits for every configured replica.
        finish_grace_s: node agents are told the job is over this long after the first replica
            finished, even if a replica is still catching up (with no donor left it never can).
        anomaly_policy: actions for training-metric anomalies over the default, as in
            ``UNBROKEN_ANOMALY_POLICY`` (which is read when this is empty).
        journal_mode: SQLite journal of the state store: ``delete`` (safe on a shared
            filesystem), ``truncate``, or ``wal`` (local disks only).
        keep_events: the newest events the state store keeps.
        max_connections: connections served at once (replicas' ranks, agents, status
            clients); more are closed at once.
        hello_timeout_s: an authenticated connection that has not said who it is (``hello``,
            ``agent_hello``) or asked for ``status`` within this is closed.
        max_world_size: the most ranks a replica may announce.
        heartbeat_s: how often each rank heartbeats (told in the welcome), while the job is small.
        max_heartbeats_per_s: heartbeat lines a second the coordinator spends on at most: past
            it the period and both silences above grow (:mod:`unbroken.control.heartbeat`).
        fatal_epochs: epochs in a row failed by a configuration error at every member that end
            the job (:mod:`unbroken.control.job_health`).
        no_progress_timeout_s: seconds without a committed step that end the job; 0 never.
    """

    total_replicas: int
    min_replicas: int = 1
    state_dir: Path = Path("unbroken-state")
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_timeout_s: float = 2.0
    suspect_after_s: float = 0.5
    join_window_floor_s: float = 0.5
    startup_window_s: float = 20.0
    finish_grace_s: float = 10.0
    anomaly_policy: str = ""
    journal_mode: str = "delete"
    keep_events: int = KEEP_EVENTS
    max_connections: int = 1024
    hello_timeout_s: float = 10.0
    max_world_size: int = 4096
    heartbeat_s: float = 0.1
    max_heartbeats_per_s: float = 2000.0
    fatal_epochs: int = DEFAULT_FATAL_EPOCHS
    no_progress_timeout_s: float = DEFAULT_NO_PROGRESS_S

    def __post_init__(self) -> None:
        names = ("heartbeat_timeout_s", "suspect_after_s", "join_window_floor_s", "startup_window_s", "hello_timeout_s")
        check_seconds({n: getattr(self, n) for n in (*names, "heartbeat_s")})  # NaN included
        check_seconds({"finish_grace_s": self.finish_grace_s}, zero_ok=True)


# A connection that sends this many malformed messages is not a replica gone astray: it is closed.
MAX_BAD_MESSAGES = 100
JOIN_WINDOW_MAX_S = 300.0  # learned from step times; never longer, whatever replicas report
MAX_SLOTS = 1024  # replicas one agent may offer to run


class Refused(Exception):
    """A request that ends its connection (a takeover of a live slot, a second identity)."""


@dataclasses.dataclass
class _RankConn:
    replica: int
    rank: int
    world_size: int
    link: protocol.Link
    transfer_addr: str
    node: str
    last_heartbeat: float
    step: int = 0
    finished: bool = False
    compute_s: float | None = None  # the rank's own compute time last step, from heartbeats
    epoch: int | None = None  # the last epoch this connection was answered with
    failure: str | None = None  # the error of its exchange in the epoch its last request says failed


@dataclasses.dataclass
class _AgentConn:
    """A node agent's connection: while it is open, the agent runs its replicas."""

    node: str
    link: protocol.Link
    last_heartbeat: float


class Coordinator:
    """One job's coordinator. Use ``await start()``, then ``address``; ``await stop()``.

    Args:
        settings: how it runs.
        secret: the job's secret; every connection must prove it holds it.
        stacks: how to get a hung rank's stack from its owner (``unbroken run`` passes its
            own); None asks the node agent that runs the replica.
        lock_fd: the state directory's lock, taken already (a standby taking over).
    """

    TICK_S = 0.05

    def __init__(
        self,
        settings: CoordinatorSettings,
        secret: JobSecret,
        stacks: StackSource | None = None,
        lock_fd: int | None = None,
    ) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError("the coordinator needs the job's JobSecret (there is no unauthenticated mode)")
        self.settings = settings
        self.secret = secret
        policy = parse_policy(settings.anomaly_policy or anomaly_policy())
        self.store = StateStore(settings.state_dir, settings.journal_mode, settings.keep_events, lock_fd=lock_fd)
        try:
            self.events = EventLog(Path(settings.state_dir) / "events.jsonl", "coordinator")
        except BaseException:
            self.store.close()
            raise
        self.events.subscribe(lambda e: self.store.record_event(e.to_json()))
        self.diagnosis = DiagnosisService(self.events, DiagnosisMaster(policy=policy), stacks or self._agent_stack)
        self.tick_errors = 0  # ticks that raised: logged, and the next tick runs all the same
        # Synced SQLite commits take tens of milliseconds on some disks: a thread of their own.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unbroken-state")
        self._persisting: asyncio.Future[int] | None = None
        first_epoch = self.store.epoch_floor
        self.quorum = QuorumState(
            QuorumRules(
                total_replicas=settings.total_replicas,
                min_replicas=settings.min_replicas,
                join_window_s=settings.join_window_floor_s,
                startup_window_s=settings.startup_window_s,
            ),
            first_epoch=first_epoch,
        )
        self.quorum.epoch_limit = self.store.epoch_ceiling
        self.replicas: dict[int, dict[int, _RankConn]] = {}
        self.pending: dict[int, dict[int, tuple[_RankConn, int, int, int | None]]] = {}
        self.step_times: deque[float] = deque(maxlen=200)
        self.assignment = Assignment(settings.total_replicas)
        self.groups: GroupLaunch | None = None  # replica groups spanning nodes (agents' --nodes-per-replica)
        self.setaside = SetAside()  # replicas whose epochs keep failing (cut off from their peers)
        self.health = JobHealth(settings.fatal_epochs, settings.no_progress_timeout_s)
        self.job_failed: JobStop | None = None  # why the job was ended, once it was
        self._held: dict[int, dict[int, tuple[_RankConn, int, int, int | None]]] = {}  # their requests
        self.agents: dict[str, _AgentConn] = {}
        self.beat = self._plan_heartbeats(settings.total_replicas)
        self._next_silence_scan = 0.0
        self.finished: set[int] = set()
        self._first_finish: float | None = None
        self._job_finished_sent = False
        self._aborted: dict[int, int] = {}
        self._aborts_pushed: int | None = None  # the broken epoch whose members were told to abort
        self._hinted: dict[int, int] = {}  # newcomer -> the epoch in which its donor was told
        self._open: set[asyncio.StreamWriter] = set()  # every connection served now
        self.auth_failures = 0  # connections dropped for failing the handshake or a MAC
        self._admission: Admission[asyncio.StreamWriter] = Admission()
        self._refusals = RefusalLog(log, "dropped connections to the coordinator")
        self.lines_in = self.lines_out = 0  # over closed connections (what `unbroken bench auth` counts)
        self._server: asyncio.base_events.Server | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._tcp_store: Any = None
        self.store_address = ""
        if first_epoch:
            self.events.emit(ev.CoordinatorRestarted(continue_after_epoch=first_epoch))

    @property
    def address(self) -> str:
        assert self._server is not None, "call start() first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # frees the state directory for the next try
            raise

    async def _start(self) -> None:
        from unbroken.wire.store import StoreServer

        # The groups' rendezvous store: authenticated, and bound to the coordinator's host only.
        self._tcp_store = StoreServer(self.settings.host, self.secret)
        self.store_address = self._tcp_store.address
        try:
            self._server = await asyncio.start_server(
                self._serve,
                self.settings.host,
                self.settings.port,
                limit=protocol.MAX_LINE,
                backlog=listen_backlog(self.settings.max_connections),
            )
        except OSError as e:
            raise OSError(
                f"the coordinator cannot listen on {self.settings.host}:{self.settings.port}: "
                f"{e.strerror}; pick another port with --port (0 picks a free one)"
            ) from e
        self._tick_task = asyncio.create_task(self._tick())
        self.events.emit(ev.CoordinatorStarted(address=self.address, store=self.store_address))

    async def stop(self) -> None:
        if self._tick_task:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
        if self._server:
            self._server.close()
            for writer in list(self._open):
                writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self._persisting is not None:
            with contextlib.suppress(Exception):
                await self._persisting
        self._writer.shutdown(wait=True)
        self.events.close()
        self.store.close()
        if self._tcp_store is not None:
            self._tcp_store.close()
        self._tcp_store = None

    # -- called by the supervisor in the same process --------------------------------------

    def replica_exited(self, replica: int, exitcode: int | None = None) -> None:
        """The supervisor saw a process of ``replica`` exit: evict it now, not on a timeout."""
        if replica in self.quorum.alive or replica in self.replicas:
            self._evict(replica, ev.EvictCause.PROCESS_EXITED, f"process exited with code {exitcode}")

    def status(self) -> dict[str, Any]:
        cur = self.quorum.current
        return {
            "epoch": cur.epoch if cur else self.quorum.epoch,
            "step": cur.step if cur else None,
            "members": list(cur.members) if cur else [],
            "forming": self.quorum.forming_since is not None,
            "join_window_s": self.quorum.join_window_s,
            "replicas": {
                r: {
                    "ranks": len(ranks),
                    "step": max((c.step for c in ranks.values()), default=0),
                    "node": next(iter(ranks.values())).node if ranks else "",
                    "alive": r in self.quorum.alive,
                    "compute_s": max((c.compute_s or 0.0 for c in ranks.values()), default=0.0),
                }
                for r, ranks in sorted(self.replicas.items())
            },
            "median_step_s": statistics.median(self.step_times) if self.step_times else None,
            "auth_failures": self.auth_failures,
            "verdicts": self.diagnosis.status(),
            "job_failed": dataclasses.asdict(self.job_failed) if self.job_failed is not None else None,
        }

    # -- connections -----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Until its ticket shows a key holder, a connection counts only against the budget of
        # strangers (newest first, wire.admission), never against max_connections. One yield
        # first: the loop then reads what arrived with the connection (a key holder's ticket)
        # before this burst of accepts can shed it.
        await asyncio.sleep(0)
        peer = writer.get_extra_info("peername")
        for shed in self._admission.admit(writer, str(peer[0]) if peer else "", time.monotonic()):
            shed.transport.abort()
        self._open.add(writer)
        conn: _RankConn | None = None
        agent: _AgentConn | None = None
        try:
            try:
                try:
                    ticket = await asyncio.wait_for(reader.readexactly(TICKET_BYTES), self._admission.policy.deadline_s)
                finally:
                    self._admission.release(writer)
                if len(self._open) - len(self._admission) > self.settings.max_connections:
                    self._dropped(f"over {self.settings.max_connections} connections", auth=False)
                    return
                session = await server_handshake_async(reader, writer, self.secret, protocol.PURPOSE, ticket=ticket)
            except (AuthError, OSError, asyncio.IncompleteReadError) as e:  # TimeoutError is an OSError
                self._dropped(str(e) or "no ticket in time")
                return
            link = protocol.Link(reader, writer, session)
            who: list[Any] = [None, None]
            try:
                await self._converse(link, who)
            finally:
                conn, agent = who
                self.lines_in += link.received
                self.lines_out += link.sent
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            log.debug("connection ended: %s", e)
        finally:
            self._open.discard(writer)
            writer.close()
            if conn is not None:
                self._connection_closed(conn)
            if agent is not None:
                self._agent_gone(
                    agent, ev.AgentLostCause.CONNECTION_CLOSED, "its connection closed (the agent or its node died)"
                )

    async def _converse(self, link: protocol.Link, who: list[Any]) -> None:
        """Serves one authenticated connection until it ends; ``who`` holds the rank connection
        and the agent it spoke as (kept up to date, so a connection error still cleans up)."""
        bad = 0
        while True:
            conn, agent = who
            anonymous = conn is None and agent is None
            try:
                # wait_for only until it said who it is: a layer of coroutine per line otherwise
                line = await (
                    asyncio.wait_for(link.readline(), self.settings.hello_timeout_s) if anonymous else link.readline()
                )
            except (asyncio.TimeoutError, TimeoutError):
                log.info("closed a connection that said no hello within %.0fs", self.settings.hello_timeout_s)
                return
            if line is None:
                return
            error: Exception
            try:
                msg = link.decode(line)
            except AuthError as e:
                self._dropped(f"{e} (from {f'replica {conn.replica} rank {conn.rank}' if conn else 'a client'})")
                return
            except ValueError as e:
                error = e
            else:
                try:
                    kind, who[0], who[1] = self._dispatch(msg, link, conn, agent)
                    if kind == "stop":
                        return
                    continue
                except Refused as e:
                    link.send(protocol.Error(str(e)).to_msg())
                    log.warning("refused: %s", e)
                    return
                except Exception as e:
                    error = e
            # A malformed message is skipped, and the connection keeps serving; only a flood of
            # them ends it.
            bad += 1
            if isinstance(error, (ValueError, TypeError, KeyError, OverflowError)):
                log.debug("malformed message skipped: %s", error)
            else:
                log.error("a message could not be handled; skipped", exc_info=error)
            link.send(protocol.Error(f"malformed message skipped: {error}").to_msg())
            if bad >= MAX_BAD_MESSAGES:
                return

    def _costs(self, replica: int, rank: int, batch: TelemetryBatch) -> None:
        """A rank's checkpoint and catch-up costs, into the event log (``/metrics`` reads them)."""
        for s in batch.saved:
            self.events.emit(
                ev.CheckpointSaved(replica=replica, rank=rank, step=s.step, stall_s=s.stall_s, nbytes=s.nbytes)
            )
        for p in batch.persisted:
            self.events.emit(
                ev.CheckpointPersisted(
                    replica=replica, rank=rank, step=p.step, ok=p.ok, persist_s=p.persist_s, nbytes=p.nbytes
                )
            )
        for c in batch.caught_up:
            self.events.emit(ev.CaughtUp(replica=replica, rank=rank, step=c.step, seconds=c.seconds, nbytes=c.nbytes))

    def _dropped(self, reason: str, auth: bool = True) -> None:
        """Counts a refused connection; logs once per interval (a flood is no log flood)."""
        if auth:
            self.auth_failures += 1
        self._refusals.note(reason, time.monotonic())

    def _dispatch(
        self, msg: dict[str, Any], link: protocol.Link, conn: _RankConn | None, agent: _AgentConn | None
    ) -> tuple[str, _RankConn | None, _AgentConn | None]:
        """Acts on one message; raises ValueError (or TypeError, KeyError) on a malformed one,
        Refused when the connection must end."""
        op = msg["op"]
        if op == "status":
            link.send({"op": "status", **self.status()})
        elif op in ("agent_hello", "hello"):
            if conn is not None or agent is not None:
                raise ValueError("a connection speaks for one replica rank or agent: it said hello already")
            try:
                if op == "agent_hello":
                    agent = self._agent_hello(protocol.AgentHello.from_msg(msg, MAX_SLOTS, MAX_NODES_PER_REPLICA), link)
                    if agent is None:
                        return "stop", conn, agent
                else:
                    conn = self._hello(protocol.Hello.from_msg(msg), link)
            except (ValueError, TypeError) as e:  # who it is cannot be malformed and skipped
                raise Refused(f"a malformed {op}: {e}") from e
        elif agent is not None:
            if op == "agent_heartbeat":
                self._agent_heartbeat(agent)
            elif self.groups is not None and op in ("exited", "group_port", "group_release"):
                {"exited": self.groups.exited, "group_port": self.groups.port, "group_release": self.groups.released}[
                    op
                ](agent.node, msg)
            elif op == "exited":
                exited = protocol.Exited.from_msg(msg)
                if self.assignment.owner.get(exited.replica) != agent.node:
                    raise ValueError(
                        f"replica {exited.replica} does not run on node {agent.node}: not its exit to report"
                    )
                self.replica_exited(exited.replica, exited.exitcode)
            elif op == "stack":
                self._agent_stack_report(agent, protocol.StackReport.from_msg(msg))
        elif conn is None:
            link.send(protocol.Error("say hello first").to_msg())
        elif op == "heartbeat":
            self._heartbeat(conn, protocol.Heartbeat.from_msg(msg))
        elif op == "telemetry":  # it carries the rank's heartbeat
            self._heartbeat(conn, protocol.Heartbeat.from_msg(msg))
            batch = TelemetryBatch.from_msg(msg)
            self.diagnosis.telemetry(conn.replica, conn.rank, conn.node, batch)
            self._costs(conn.replica, conn.rank, batch)
        elif op == "quorum":
            conn.last_heartbeat = time.monotonic()
            self._quorum_request(conn, protocol.QuorumAsk.from_msg(msg))
        elif op == "bye":
            if not conn.finished:
                conn.finished = True
                self.diagnosis.forget(conn.replica)  # its last, half-shipped collective is no hang
                self.events.emit(ev.ReplicaFinished(replica=conn.replica, rank=conn.rank))
                self._replica_done(conn)
        elif op == "exited":
            exited = protocol.Exited.from_msg(msg)
            if exited.replica != conn.replica:
                raise ValueError(f"replica {conn.replica} may report only its own exit, not replica {exited.replica}'s")
            self.replica_exited(exited.replica, exited.exitcode)
        return op, conn, agent

    @staticmethod
    def _heartbeat(conn: _RankConn, beat: protocol.Heartbeat) -> None:
        conn.last_heartbeat = time.monotonic()
        if beat.step is not None:
            conn.step = max(conn.step, beat.step)
        if beat.compute_s is not None:
            conn.compute_s = beat.compute_s

    def _hello(self, hello: protocol.Hello, link: protocol.Link) -> _RankConn:
        replica, world_size, rank = hello.replica, hello.world_size, hello.rank
        if replica >= self.settings.total_replicas:
            raise Refused(f"replica {replica} is not one of this job's {self.settings.total_replicas} replicas")
        if not 1 <= world_size <= self.settings.max_world_size:
            raise Refused(f"world_size must be 1 to {self.settings.max_world_size}, got {world_size}")
        if rank >= world_size:
            raise Refused(f"rank {rank} is not below world_size {world_size}")
        ranks = self.replicas.get(replica, {})
        if any(c.world_size != world_size for c in ranks.values()):
            raise Refused(
                f"replica {replica} has ranks of world_size "
                f"{next(iter(ranks.values())).world_size}, not {world_size}"
            )
        if rank in ranks:
            # Refused while the old connection lives: it ends when its process dies, or when it
            # is evicted for silence; the client then reconnects and is served.
            raise Refused(
                f"replica {replica} rank {rank} is already connected: refused until that " "connection is gone"
            )
        conn = _RankConn(
            replica=replica,
            rank=rank,
            world_size=world_size,
            link=link,
            transfer_addr=hello.transfer_addr,
            node=hello.node,
            last_heartbeat=time.monotonic(),
            step=hello.step,
        )
        ranks = self.replicas.setdefault(replica, {})
        ranks[rank] = conn
        plan = self._plan_heartbeats(self.settings.total_replicas * world_size)
        if plan.period_s > self.beat.period_s:  # only ever slower: a rank told the old period is still in time
            self.beat = plan
        link.send(
            protocol.Welcome(
                store=self._store_for(link),
                epoch=self.quorum.epoch,
                heartbeat_s=self.beat.period_s,
                timeout_s=self.beat.timeout_s,
            ).to_msg()
        )
        if len(ranks) == conn.world_size:
            self.quorum.connect(conn.replica)
            self.events.emit(ev.ReplicaConnected(replica=conn.replica, node=conn.node, step=conn.step))
        return conn

    def _plan_heartbeats(self, ranks: int) -> HeartbeatPlan:
        s = self.settings
        return plan_heartbeats(ranks, s.heartbeat_s, s.suspect_after_s, s.heartbeat_timeout_s, s.max_heartbeats_per_s)

    def _connection_closed(self, conn: _RankConn) -> None:
        ranks = self.replicas.get(conn.replica, {})
        if ranks.get(conn.rank) is not conn:
            return  # already replaced by a reconnect
        del ranks[conn.rank]
        if not ranks:
            self.replicas.pop(conn.replica, None)
        if conn.finished:
            self.pending.pop(conn.replica, None)
            self.quorum.alive.discard(conn.replica)
            return
        self._evict(
            conn.replica, ev.EvictCause.CONNECTION_CLOSED, "connection closed (process died or lost its network)"
        )

    def _evict(self, replica: int, cause: ev.EvictCause, reason: str) -> None:
        for conn in list(self.replicas.pop(replica, {}).values()):
            conn.link.close()
        self.pending.pop(replica, None)
        self._held.pop(replica, None)
        was_member = self.quorum.current is not None and replica in self.quorum.current.member_set
        self.diagnosis.forget(replica)
        self.events.emit(ev.ReplicaEvicted(replica=replica, cause=cause, reason=reason, member=was_member))
        self._deliver(self.quorum.disconnect(replica, time.monotonic()))
        self._push_aborts()

    # -- node agents -----------------------------------------------------------------------

    def _agent_hello(self, hello: protocol.AgentHello, link: protocol.Link) -> _AgentConn | None:
        node = hello.node
        expected = self.groups.nodes_per_replica if self.groups else 1 if self.agents else hello.nodes_per_replica
        if expected != hello.nodes_per_replica:
            link.send(
                protocol.Error(
                    f"this job's agents run replica groups of {expected} node(s), not "
                    f"{hello.nodes_per_replica}: give every agent the same --nodes-per-replica"
                ).to_msg()
            )
            return None
        if hello.nodes_per_replica > 1:
            return self._group_agent_hello(hello, link)
        try:
            busy = {r for r, conns in self.replicas.items() if conns}
            replicas = self.assignment.join(node, hello.slots, running=list(hello.running), busy=busy)
        except ValueError as e:
            link.send(protocol.Error(str(e)).to_msg())
            return None
        agent = _AgentConn(node=node, link=link, last_heartbeat=time.monotonic())
        self.agents[node] = agent
        self.events.emit(ev.AgentJoined(node=node, slots=self.assignment.slots[node], replicas=replicas))
        link.send(protocol.Assign(replicas=replicas, num_replicas=self.settings.total_replicas).to_msg())
        return agent

    def _group_agent_hello(self, hello: protocol.AgentHello, link: protocol.Link) -> _AgentConn | None:
        """An agent of a job whose replica groups span nodes (:mod:`unbroken.control.groups`)."""
        node = hello.node
        addr = advertised_address({"addr": hello.addr})
        if self.groups is None:
            self.groups = GroupLaunch(self, hello.nodes_per_replica)
        if node in self.groups.assignment.slots:
            link.send(protocol.Error(f"an agent for node {node!r} is already connected").to_msg())
            return None
        agent = _AgentConn(node=node, link=link, last_heartbeat=time.monotonic())
        self.agents[node] = agent
        link.send(protocol.Assign(replicas=[], num_replicas=self.settings.total_replicas).to_msg())
        replicas = self.groups.hello(node, hello.slots, addr)
        self.events.emit(ev.AgentJoined(node=node, slots=hello.slots, replicas=replicas, addr=addr))
        return agent

    def _agent_heartbeat(self, agent: _AgentConn) -> None:
        agent.last_heartbeat = time.monotonic()
        mine = self.groups.replicas_of(agent.node) if self.groups else self.assignment.replicas_of(agent.node)
        steps = {
            str(r): max((c.step for c in self.replicas[r].values()), default=0) for r in mine if r in self.replicas
        }
        agent.link.send(protocol.AgentStatus(steps=steps).to_msg())

    async def _agent_stack(self, replica: int, rank: int) -> dict[str, Any]:
        """A hung rank's stack when no supervisor runs here: its node agent is asked to dump it.

        The agent signals its own child and reads the file it computes from its own run
        directory; its answer lands in this log as a ``stack`` event.
        """
        node = self.assignment.owner.get(replica)
        if self.groups is not None:
            node, rank = self.groups.stack_target(replica, rank) or (None, rank)
        agent = self.agents.get(node) if node is not None else None
        if agent is None:
            return {"stack_note": "no supervisor or agent runs this replica: no stack"}
        agent.link.send(protocol.DumpStack(replica=replica, rank=rank).to_msg())
        return {"stack_note": f"asked the agent on node {node} for the stack (a `stack` event follows)"}

    def _agent_stack_report(self, agent: _AgentConn, report: protocol.StackReport) -> None:
        if not (
            self.groups.runs(report.replica, agent.node)
            if self.groups
            else self.assignment.owner.get(report.replica) == agent.node
        ):
            raise ValueError(f"replica {report.replica} does not run on node {agent.node}")
        self.events.emit(
            ev.Stack(
                replica=report.replica,
                rank=report.rank,
                node=agent.node,
                process_state=report.process_state,
                stack=report.stack,
                stack_note=report.stack_note,
            )
        )

    def _agent_gone(self, agent: _AgentConn, cause: ev.AgentLostCause, reason: str) -> None:
        """All of the agent's replicas are gone with it: evict them now, move them to spare slots."""
        if self.agents.get(agent.node) is not agent:
            return
        del self.agents[agent.node]
        agent.link.close()
        if self.groups is not None:
            self.events.emit(
                ev.AgentLost(node=agent.node, replicas=self.groups.replicas_of(agent.node), cause=cause, reason=reason)
            )
            self.groups.gone(agent.node, reason)
            self._check_job_finished()
            return
        lost, moves = self.assignment.leave(agent.node, done=self.finished)
        self.events.emit(ev.AgentLost(node=agent.node, replicas=lost, cause=cause, reason=reason))
        for r in lost:
            if r not in self.finished and (r in self.quorum.alive or r in self.replicas):
                self._evict(r, ev.EvictCause.AGENT_LOST, f"its agent on node {agent.node} is gone: {reason}")
        for node, replicas in moves.items():
            for r in replicas:
                self.events.emit(ev.ReplicaReassigned(replica=r, from_node=agent.node, to_node=node))
            self.agents[node].link.send(
                protocol.Assign(replicas=replicas, num_replicas=self.settings.total_replicas).to_msg()
            )
        self._check_job_finished()

    def _replica_done(self, conn: _RankConn) -> None:
        ranks = self.replicas.get(conn.replica, {})
        if len(ranks) == conn.world_size and all(c.finished for c in ranks.values()):
            self.finished.add(conn.replica)
            if self._first_finish is None:
                self._first_finish = time.monotonic()
            self._check_job_finished()

    def _check_job_finished(self) -> None:
        """Tells every agent the job is over once no replica that still runs is left to finish."""
        if self._job_finished_sent or not self.agents or self._first_finish is None:
            return
        late = time.monotonic() - self._first_finish > self.settings.finish_grace_s
        assigned = self.groups.assigned() if self.groups else self.assignment.owner
        if not late and any(r not in self.finished for r in assigned):
            return
        self._job_finished_sent = True
        self.events.emit(ev.JobFinished(finished=sorted(self.finished)))
        for agent in self.agents.values():
            agent.link.send({"op": "job_finished"})

    def _store_for(self, link: protocol.Link) -> str:
        """The TCPStore's address as seen by this client (a wildcard bind is no address to dial)."""
        if self.settings.host not in ("0.0.0.0", "::", ""):
            return self.store_address
        host = link.writer.get_extra_info("sockname")[0]
        return f"{host}:{self.store_address.rpartition(':')[2]}"

    # -- quorum ----------------------------------------------------------------------------

    def _quorum_request(self, conn: _RankConn, ask: protocol.QuorumAsk) -> None:
        """Validates a rank's quorum request, and forms or answers what it can.

        A member may not ask for a step below the one its epoch trains (steps it has committed):
        that is a replica whose state went back, and it is treated as the failure it is (evicted:
        it rejoins as a newcomer and catches up), not as a reason to re-form every member's
        epoch. A failure report counts only from a member of the current epoch about that epoch:
        anything else would let one replica abort exchanges it is not part of.
        """
        step_time, step, req_id, failed = ask.step_time, ask.step, ask.id, ask.failed_epoch
        if conn.finished:
            raise ValueError("a replica that said bye asks for no quorum")
        if failed is not None and failed > self.quorum.epoch:
            raise ValueError(f"failed_epoch {failed} was never formed (the newest is {self.quorum.epoch})")
        cur = self.quorum.current
        # This very connection trains in the current epoch (a restarted process of a member
        # of it is a newcomer: it asks for the step of its checkpoint, and catches up).
        member = cur is not None and conn.epoch == cur.epoch and conn.replica in cur.member_set
        if cur is not None and member and step < cur.step:
            self._evict(
                conn.replica,
                ev.EvictCause.STEP_WENT_BACK,
                f"rank {conn.rank} asked for step {step}, below step {cur.step} that its " f"epoch {cur.epoch} trains",
            )
            return
        if failed is not None and not (member and cur is not None and failed == cur.epoch):
            failed = None  # not this replica's exchange to fail, or a stale report
        conn.failure = ask.failure if failed is not None else None
        if step_time:
            self.step_times.append(step_time)
        now = time.monotonic()
        self.health.asked(now)
        if member and cur is not None and step > cur.step:
            self.setaside.progressed()
            self.health.progressed(now)
        conn.step = step
        ranks = self.pending.setdefault(conn.replica, {})
        ranks[conn.rank] = (conn, req_id, conn.step, failed)
        if len(ranks) < conn.world_size:
            return
        del self.pending[conn.replica]
        self._submit(conn.replica, ranks)

    def _submit(self, replica: int, ranks: dict[int, tuple[_RankConn, int, int, int | None]]) -> None:
        """A replica's request, once all its ranks asked: answered, forming, or held (set aside)."""
        now = time.monotonic()
        cur = self.quorum.current
        failed_epochs = [f for (_, _, _, f) in ranks.values() if f is not None]
        if failed_epochs and cur is not None and max(failed_epochs) == cur.epoch:
            self._judge_failure(cur.epoch, cur.members, replica, [c.failure for (c, _, _, _) in ranks.values()])
            victim = self.setaside.failed(cur.epoch, cur.members, self.settings.min_replicas, now)
            if victim is not None:
                self.events.emit(
                    "replica_set_aside",
                    replica=victim,
                    failed_epochs=list(self.setaside.streak),
                    hold_s=round(self.setaside.until[victim] - now, 3),
                    reason="its epochs keep failing: cut off from its peers?",
                )
                self.quorum.waiting.pop(victim, None)
                if victim in self.pending and victim != replica:
                    self._held[victim] = self.pending.pop(victim)
        if replica in self.setaside.held(now):
            self._held[replica] = ranks
            return
        conn = next(iter(ranks.values()))[0]
        failures = [f for (_, _, _, f) in ranks.values() if f is not None]
        req = QuorumRequest(
            replica=conn.replica,
            step=min(s for (_, _, s, _) in ranks.values()),
            failed_epoch=max(failures) if failures else None,
        )
        if req.failed_epoch is not None:
            self.events.emit(ev.ExchangeFailed(replica=req.replica, epoch=req.failed_epoch, step=req.step))
        newcomer = cur is None or req.replica not in cur.member_set
        answer, formed = self.quorum.request(req, time.monotonic())
        if answer is not None:
            self._reply(answer, {req.replica: ranks})
        else:
            self.pending[conn.replica] = ranks
        self._deliver(formed)
        self._push_aborts()
        if newcomer:  # only a newcomer's request changes the forecast: no scan of the members on every request
            self._hint_donors()

    def _judge_failure(self, epoch: int, members: Iterable[int], replica: int, errors: list[str | None]) -> None:
        """A replica's report that ``epoch`` failed: a configuration error at every member, epochs
        in a row, ends the job (:mod:`unbroken.control.job_health`)."""
        texts = [e for e in errors if e]
        fatal = [e for e in texts if classify(e).fatal]
        error = fatal[0] if fatal else texts[0] if texts else None
        stop = self.health.failed(epoch, members, replica, error)
        if stop is not None:
            self._fail_job(stop)

    def _fail_job(self, stop: JobStop) -> None:
        """Ends the job: the event says why; ``unbroken run`` (subscribed) and every agent stop
        their workers and exit with ``stop.exit_code``."""
        if self.job_failed is not None:
            return
        self.job_failed = stop
        log.error("the job is stopped: %s", stop.reason)
        self.events.emit(
            ev.JobFailed(
                reason=stop.reason,
                exit_code=stop.exit_code,
                cause=stop.cause,
                error=stop.error,
                members=list(stop.members),
                hint=stop.hint,
            )
        )
        for agent in self.agents.values():
            agent.link.send(protocol.JobFailedNotice(reason=stop.reason, exit_code=stop.exit_code).to_msg())

    def _hint_donors(self) -> None:
        """Tells each member about to serve a newcomer, once, so it snapshots at its next step start.

        Without the hint a donor learns of its task from the quorum answer, mid-forward, and
        can snapshot only after its backward pass (the training thread owns the state); the
        transfer then spans that step and part of the next, which every member waits for.
        """
        epoch = self.quorum.epoch  # a forecast exists only while a decision stands
        for joiner, donor in self.quorum.upcoming_donors().items():
            if self._hinted.get(joiner) == epoch:
                continue
            self._hinted[joiner] = epoch
            self.events.emit(ev.DonorTold(newcomer=joiner, donor=donor, epoch=epoch))
            for conn in self.replicas.get(donor, {}).values():
                conn.link.send(protocol.Donate(to=joiner).to_msg())

    def _deliver(self, decisions: list[QuorumDecision]) -> None:
        for d in decisions:
            self.setaside.formed(d.epoch, d.members)
            self.store.record_epoch(d.epoch, d.step, list(d.members), list(d.behind))
            self.events.emit(
                ev.Quorum(
                    epoch=d.epoch,
                    step=d.step,
                    members=list(d.members),
                    behind=list(d.behind),
                    donors=[list(p) for p in d.donors],
                )
            )
            waiting = {m: self.pending.pop(m) for m in d.members if m in self.pending}
            self._reply(d, waiting)

    def _reply(self, d: QuorumDecision, waiting: dict[int, dict[int, tuple[_RankConn, int, int, int | None]]]) -> None:
        """Answers the ranks in ``waiting`` with ``d``.

        A connection already told this epoch gets the short answer (:class:`protocol.QuorumSame`):
        the fast path costs the same at 5,000 members as at 3. A full answer's text is made once
        per store address and shared; only a replica that is behind gets a transfer address, its
        donor's (the one it fetches from), so an epoch's answers do not carry every member's
        address to every member (at 1,000 members that was 35 KB per answer, 35 MB per epoch),
        and a member named in donor pairs gets those alone (every pair to every member was 60 KB
        an answer with most of 5,000 members behind).
        """
        tails: dict[str, bytes] = {}
        decision: dict[str, object] | None = None
        donors = dict(d.donors)
        pairs = d.donors_by_replica() if d.donors else {}  # a member gets only the pairs that name it
        for replica, ranks in waiting.items():
            for rank, (conn, req_id, _, _) in ranks.items():
                if conn.epoch == d.epoch and not d.behind:
                    conn.link.send(protocol.QuorumSame(id=req_id, same_epoch=d.epoch, step=d.step).to_msg())
                    continue
                conn.epoch = d.epoch
                store = self._store_for(conn.link)
                decision = decision or {**d.to_json(), "donors": []}
                donor = donors.get(replica)
                if replica in pairs:
                    mine = {**decision, "donors": pairs[replica]}
                    addrs: dict[str, str] = {}
                    if donor is not None:  # the address of its donor's rank of the same index
                        peer = self.replicas.get(donor, {}).get(rank)
                        addrs = {str(donor): peer.transfer_addr} if peer is not None else {}
                    conn.link.send_payload(protocol.answer_payload(req_id, protocol.answer_tail(mine, addrs, store)))
                    continue
                tail = tails.get(store)
                if tail is None:
                    tail = tails[store] = protocol.answer_tail(decision, {}, store)
                conn.link.send_payload(protocol.answer_payload(req_id, tail))

    def _push_aborts(self) -> None:
        """Tells every member still in the broken epoch's exchange to abort it, once per epoch.

        Once: the members of a broken epoch only leave it, never join it, so after the first push
        every later call would scan the whole membership (on each request while forming) to
        find nobody.
        """
        cur = self.quorum.current
        if cur is None or not self.quorum.broken or self._aborts_pushed == cur.epoch:
            return
        self._aborts_pushed = cur.epoch
        for replica in self.quorum.in_flight_members():
            if self._aborted.get(replica) == cur.epoch:
                continue
            self._aborted[replica] = cur.epoch
            for conn in self.replicas.get(replica, {}).values():
                conn.link.send(protocol.Abort(epoch=cur.epoch).to_msg())

    async def _tick(self) -> None:
        """Evicts the silent, forms epochs on time, persists: one exception must not end it, or
        a dead replica stays counted as alive and the survivors wait forever."""
        while True:
            await asyncio.sleep(self.TICK_S)
            try:
                self._tick_once(time.monotonic())
            except Exception:
                self.tick_errors += 1
                if self.tick_errors & (self.tick_errors - 1) == 0:  # 1st, 2nd, 4th...: not 20 a second
                    log.exception(
                        "coordinator tick failed (%d so far); the next tick runs all the same", self.tick_errors
                    )

    def _tick_once(self, now: float) -> None:
        for agent in list(self.agents.values()):
            if now - agent.last_heartbeat > 2 * self.settings.heartbeat_timeout_s:
                self._agent_gone(
                    agent,
                    ev.AgentLostCause.NO_HEARTBEAT,
                    f"no heartbeat for {2 * self.settings.heartbeat_timeout_s:.1f}s",
                )
        self._check_job_finished()
        suspects = self.quorum.silent & self.quorum.alive
        if now >= self._next_silence_scan:  # a scan of every replica: a fifth of the suspect time is soon enough
            self._next_silence_scan = now + self.beat.suspect_after_s / 5
            suspects = self._scan_silence(now)
        held = self.setaside.held(now)
        for replica in [r for r in self._held if r not in held]:
            asked = {k: v for k, v in self._held.pop(replica).items() if self.replicas.get(replica, {}).get(k) is v[0]}
            if asked and len(asked) == next(iter(asked.values()))[0].world_size:
                self._submit(replica, asked)
        suspects |= held & self.quorum.alive
        if suspects != self.quorum.silent:
            if suspects - self.quorum.silent:
                self.events.emit(
                    ev.ReplicaSilent(replicas=sorted(suspects - self.quorum.silent), after_s=self.beat.suspect_after_s)
                )
            self._deliver(self.quorum.set_silent(suspects, now))
        if len(self.step_times) >= 5:
            self.quorum.join_window_s = min(
                JOIN_WINDOW_MAX_S, max(self.settings.join_window_floor_s, 3.0 * statistics.median(self.step_times))
            )
        self._persist()
        self._deliver(self.quorum.evaluate(now))
        self._push_aborts()
        self.diagnosis.tick()
        if self.job_failed is None:
            cur = self.quorum.current
            stop = self.health.check(now, cur.members if cur is not None else ())
            if stop is not None:
                self._fail_job(stop)

    def _scan_silence(self, now: float) -> set[int]:
        """Evicts the replicas silent past the timeout; returns those silent past the suspect time."""
        suspects = set()
        timeout, suspect = self.beat.timeout_s, self.beat.suspect_after_s
        for replica, ranks in list(self.replicas.items()):
            if any(c.finished for c in ranks.values()):
                continue
            quiet = now - min((c.last_heartbeat for c in ranks.values()), default=now)
            if quiet > timeout:
                self._evict(replica, ev.EvictCause.NO_HEARTBEAT, f"silent for {timeout:.1f}s (hung or stopped)")
            elif quiet > suspect:
                suspects.add(replica)
        return suspects

    def _persist(self) -> None:
        """Has the writer thread reserve epochs ahead of the ones issued and write the queued
        history; the limit on new epochs rises once the reservation is on disk."""
        if self._persisting is not None and not self._persisting.done():
            return
        self._persisting = asyncio.get_running_loop().run_in_executor(
            self._writer, self.store.persist, self.quorum.epoch
        )
        self._persisting.add_done_callback(self._persisted)

    def _persisted(self, done: asyncio.Future[int]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.quorum.epoch_limit = done.result()
