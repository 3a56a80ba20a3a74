"""The coordinator service: membership, quorum epochs, pushed aborts, persisted history.

A thin asyncio shell around :mod:`unbroken.control.quorum.rules`. Each rank of each replica keeps one
TCP connection open (see :mod:`unbroken.control.protocol`); a closed connection or a process
exit reported by the supervisor evicts the replica at once, a silent one is evicted when its
heartbeats stop. The coordinator also hosts the ``torch.distributed`` TCPStore on which the
cross-replica groups of every epoch rendezvous.

Its parts, each given what it needs through its constructor: the connections are served by
:mod:`unbroken.control.protocol.serving`, ranks' quorum requests answered by
:mod:`unbroken.control.quorum.service`, node agents kept by :mod:`unbroken.control.nodes.agents`
(which replica runs where: :mod:`unbroken.control.nodes.placement`). What stays here is the identity
of each rank connection, eviction, the tick and the persisted history.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unbroken.config import anomaly_policy
from unbroken.control import protocol
from unbroken.control.coordinator_settings import CoordinatorSettings
from unbroken.control.nodes.agents import NodeAgents
from unbroken.control.nodes.groups import MAX_NODES_PER_REPLICA
from unbroken.control.nodes.node_relay import NodeConn, NodeRelay, PreSaid, RelayHooks
from unbroken.control.nodes.placement import AgentConn, PlacementHooks
from unbroken.control.protocol.event_loop import listen_backlog
from unbroken.control.protocol.serving import ConnectionServer, Refused
from unbroken.control.quorum.heartbeat import ALIVE_S, HeartbeatPlan, alive_every, plan_heartbeats
from unbroken.control.quorum.job_health import JobHealth, JobStop
from unbroken.control.quorum.resume import EpochResume
from unbroken.control.quorum.rules import QuorumRules, QuorumState, decision
from unbroken.control.quorum.service import QuorumHooks, QuorumService, RankConn
from unbroken.control.state.state_store import StateStore
from unbroken.diagnosis.master.master import DiagnosisMaster
from unbroken.diagnosis.master.master_service import DiagnosisService, StackSource
from unbroken.diagnosis.rules.metrics import parse_policy
from unbroken.diagnosis.telemetry import TelemetryBatch
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog
from unbroken.wire.auth import JobSecret

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "CoordinatorSettings", "Refused"]


JOIN_WINDOW_MAX_S = 300.0  # learned from step times; never longer, whatever replicas report
MAX_SLOTS = 1024  # replicas one agent may offer to run
# How long the replicas registered at a restart or a takeover wait to be logged: past the burst of
# answers (12,500 events took the standby 0.2 s to write, before it answered any request; its burst
# of answers at 12,500 nodes is 1 to 3 s).
BURST_S = 5.0
GRANT_SLACK_S = 1.0  # past max_grant_s, the longest a previous coordinator's grant may still stand


async def listen(settings: CoordinatorSettings, connections: ConnectionServer[Any, Any]) -> asyncio.base_events.Server:
    """The coordinator's listener at ``settings.host:port``, served by ``connections`` (a standby
    binds it before it takes over: :meth:`ConnectionServer.hold`).

    Raises:
        OSError: the address cannot be bound, saying which and what to do.
    """
    try:
        return await asyncio.start_server(
            connections.serve,
            settings.host,
            settings.port,
            limit=protocol.MAX_LINE,
            backlog=listen_backlog(settings.max_connections),
        )
    except OSError as e:
        raise OSError(
            f"the coordinator cannot listen on {settings.host}:{settings.port}: "
            f"{e.strerror}; pick another port with --port (0 picks a free one)"
        ) from e


class Coordinator:
    """One job's coordinator. Use ``await start()``, then ``address``; ``await stop()``.

    Args:
        settings: how it runs.
        secret: the job's secret; every connection must prove it holds it.
        stacks: how to get a hung rank's stack from its owner (``unbroken run`` passes its
            own); None asks the node agent that runs the replica.
        lock_fd: the state directory's lock, taken already (a standby taking over).
        fence: whether this coordinator may answer now (its lease, :mod:`unbroken.control.state.lease`),
            asked before every answer: while it says no, a message waits unanswered on its
            connection (kept), a closed connection's eviction waits, and the tick does nothing;
            once it says yes again, the silence it could not hear is not held against anyone.
            None: always.
        held_by_lease: the state directory is held through the lease alone (a standby took over
            from a hung coordinator that still holds the lock).
        listening: a standby's listener and the connections it holds already
            (:meth:`ConnectionServer.hold`): served from :meth:`start` on, instead of a new listener.
        presaid: the node hellos said to that standby beforehand: registered in :meth:`start`,
            before any line is read.
        term: the lease term held (said in every welcome: clients drop older terms); None
            without a lease.
    """

    TICK_S = 0.05

    def __init__(
        self,
        settings: CoordinatorSettings,
        secret: JobSecret,
        stacks: StackSource | None = None,
        lock_fd: int | None = None,
        fence: Callable[[], bool] | None = None,
        held_by_lease: bool = False,
        listening: tuple[ConnectionServer[Any, Any], asyncio.base_events.Server] | None = None,
        presaid: PreSaid | None = None,
        term: int | None = None,
    ) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError("the coordinator needs the job's JobSecret (there is no unauthenticated mode)")
        self.settings = settings
        self.secret = secret
        policy = parse_policy(settings.anomaly_policy or anomaly_policy())
        self.fence = fence or (lambda: True)
        self.term = term  # the lease's term, said in every welcome (the clients' fencing token)
        self.fenced_off = 0  # messages and ticks left unanswered because the lease was not valid
        self.store = StateStore(
            settings.state_dir, settings.journal_mode, settings.keep_events, lock_fd=lock_fd, fenced=held_by_lease
        )
        try:
            self.events = EventLog(Path(settings.state_dir) / "events.jsonl", "coordinator")
        except BaseException:
            self.store.close()
            raise
        self.events.subscribe(lambda e: self.store.record_event(e.to_json()))
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
                max_members=settings.max_members,
            ),
            first_epoch=first_epoch,
        )
        self.quorum.epoch_limit = self.store.epoch_ceiling
        self.replicas: dict[int, dict[int, RankConn]] = {}
        self.health = JobHealth(settings.fatal_epochs, settings.no_progress_timeout_s)
        self.job_failed: JobStop | None = None  # why the job was ended, once it was
        self.finished: set[int] = set()
        self.agents = NodeAgents(
            PlacementHooks(
                total_replicas=settings.total_replicas,
                events=self.events,
                send=lambda node, msg: self.agents.send(node, msg),
                evict=self.evict,
                finished=self.finished,
                job_over=lambda: self.agents.job_over,
                world_size=self._world_size,
                busy=lambda: {r for r, conns in self.replicas.items() if conns},
                term=term,
                hot_spares=settings.total_replicas - (settings.max_members or settings.total_replicas),
                parked=lambda: self.quorum.parked.keys(),
            ),
            steps=self._steps,
            finish_grace_s=settings.finish_grace_s,
        )
        self.requests = QuorumService(
            self.quorum,
            self.replicas,
            settings.min_replicas,
            self.store,
            self.events,
            self.health,
            QuorumHooks(evict=self._evict, fail_job=self._fail_job, store_for=self._store_for, blame=self._stall_blame),
            max_asks_per_s=settings.max_asks_per_s,
            max_grant_s=settings.max_grant_s,
        )
        self.diagnosis = DiagnosisService(
            self.events, DiagnosisMaster(policy=policy), stacks or self.agents.request_stack
        )
        self._listening, self._presaid, self._held_by_lease = listening, presaid, held_by_lease
        self.connections: ConnectionServer[RankConn | NodeConn, AgentConn]
        if listening is not None:
            self.connections = listening[0]
        else:
            self.connections = ConnectionServer(
                secret, settings.max_connections, settings.hello_timeout_s, self._dispatch, self._closed
            )
        self.connections.fence = None if fence is None else self.fence
        self._fenced_since: float | None = None  # when the tick last found the lease lapsed
        self._closing_fenced: set[asyncio.Task[None]] = set()  # closed connections waiting for the lease
        self.beat = self._plan_heartbeats(settings.total_replicas)
        self._next_silence_scan = 0.0
        self._next_alive = 0.0
        self._alive_s: float | None = None  # alive_every() of the timeout the first welcome told
        self._planned_for = 0  # the world size the heartbeat plan was last sized for
        self._welcomes: tuple[tuple[str, int, float, float] | None, bytes] = (None, b"")  # the last welcome made
        self._server: asyncio.base_events.Server | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._tcp_store: Any = None
        self.store_address = ""
        # What a rank's connection may say once it said hello (``hello`` and ``status`` aside).
        self.rank_ops: dict[str, Callable[[RankConn, protocol.Message], None]] = {
            protocol.Heartbeat.OP: lambda conn, msg: self._heartbeat(conn, protocol.Heartbeat.from_msg(msg)),
            protocol.Telemetry.OP: self._telemetry,
            protocol.QuorumAsk.OP: self._quorum,
            protocol.Bye.OP: lambda conn, _: self._bye(conn),
            protocol.Exited.OP: self._rank_exited,
        }
        # A node agent's connection speaking for its node's ranks (:mod:`unbroken.control.nodes.node_relay`).
        self.nodes = NodeRelay(
            RelayHooks(
                admit=self._admit,
                quorum=self.requests.ask_ranks,
                closed=self._connection_closed,
                said=self._node_said,
                claim=self._claim,
                elsewhere=self.agents.elsewhere,
            ),
            coordinator_host=settings.host,
        )
        if first_epoch:
            self.events.emit(ev.CoordinatorRestarted(continue_after_epoch=first_epoch))
        last = self.store.last_epoch()
        # The epoch the job trains in goes on under this coordinator (a restart, a takeover).
        self.resumed = (
            EpochResume(decision(*last), self.quorum, self.replicas, self.events, self.evict, settings.startup_window_s)
            if last is not None
            else None
        )
        # The previous coordinator's grants run out within max_grant_s (and a step's slack): until
        # then no newcomer is admitted (QuorumState.resume; its relays keep them across a takeover).
        self._grants_lift_at = time.monotonic() + settings.max_grant_s + GRANT_SLACK_S if last is not None else 0.0

    @property
    def address(self) -> str:
        assert self._server is not None, "call start() first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    @property
    def pending(self) -> dict[int, Any]:
        """Replicas whose ranks asked for a quorum not yet answered."""
        return self.requests.pending

    @property
    def auth_failures(self) -> int:
        """Connections dropped for failing the handshake or a MAC."""
        return self.connections.auth_failures

    @property
    def lines_in(self) -> int:
        return self.connections.lines_in

    @property
    def lines_out(self) -> int:
        return self.connections.lines_out

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
        if self._listening is not None:  # a standby's: it holds the node agents' connections already
            self._server = self._listening[1]
        else:
            self._server = await listen(self.settings, self.connections)
        self._tick_task = asyncio.create_task(self._tick())
        self.events.emit(ev.CoordinatorStarted(address=self.address, store=self.store_address))
        # A standby's held connections are served from now, the nodes that said hello beforehand registered first.
        adopted = None
        if self._presaid is not None:
            died = not self._held_by_lease  # the lock was free: its process is gone (it does not hang)
            adopted = self._presaid.adopt(self.nodes, self.connections.speaking, self._claim_stands, died)
        self.connections.open_to(self._dispatch, self._closed, adopted)

    async def stop(self, abort: bool = False) -> None:
        """Stops serving; ``abort``: it stepped down (its lease lost or its store failed), and
        what is queued to its connections is dropped, not sent."""
        for task in list(self._closing_fenced):
            task.cancel()
        if self._tick_task:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
        if self._server:
            self._server.close()
            self.connections.close_all(abort=abort)
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
        self.evict(replica, ev.EvictCause.PROCESS_EXITED, f"process exited with code {exitcode}")

    def evict(self, replica: int, cause: ev.EvictCause, reason: str) -> None:
        """Evicts ``replica`` if it is still connected or counted alive (else nothing is left to do)."""
        if replica in self.quorum.alive or replica in self.replicas:
            self._evict(replica, cause, reason)

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
            "granted": self.requests.granted,  # fast answers a node's relay repeats for the next steps
            "median_step_s": statistics.median(self.requests.step_times) if self.requests.step_times else None,
            "auth_failures": self.auth_failures,
            "nodes": self.nodes.status(),  # node agents relaying their ranks: ranks spoken for, by node
            "verdicts": self.diagnosis.status(),
            "job_failed": dataclasses.asdict(self.job_failed) if self.job_failed is not None else None,
        }

    # -- one message -----------------------------------------------------------------------

    def _dispatch(
        self, msg: protocol.Message, link: protocol.Link, conn: RankConn | NodeConn | None, agent: AgentConn | None
    ) -> tuple[str, RankConn | NodeConn | None, AgentConn | None]:
        """Acts on one message; raises ValueError (or TypeError, KeyError) on a malformed one,
        Refused when the connection must end. Called only while the lease is valid: the
        connection server holds each line until it is (:meth:`ConnectionServer._until_fenced_in`),
        with no await between that check and this call."""
        op = msg["op"]
        if op == protocol.StatusRequest.OP:
            link.send({"op": "status", **self.status()})
        elif isinstance(conn, NodeConn):
            self.nodes.handle(conn, op, msg)
        elif op == protocol.NodeHello.OP and conn is None and agent is None:
            try:
                conn = self.nodes.open(protocol.NodeHello.from_msg(msg), link)
            except (ValueError, TypeError) as e:
                raise Refused(f"a malformed {op}: {e}") from e
        elif op in (protocol.AgentHello.OP, protocol.Hello.OP):
            if conn is not None or agent is not None:
                raise ValueError("a connection speaks for one replica rank or agent: it said hello already")
            try:
                if op == protocol.AgentHello.OP:
                    hello = protocol.AgentHello.from_msg(msg, MAX_SLOTS, MAX_NODES_PER_REPLICA)
                    agent = self.agents.hello(hello, link)
                    if agent is None:
                        return "stop", conn, agent
                else:
                    conn = self._hello(protocol.Hello.from_msg(msg), link)
            except (ValueError, TypeError) as e:  # who it is cannot be malformed and skipped
                raise Refused(f"a malformed {op}: {e}") from e
        elif agent is not None:
            self.agents.handle(agent, op, msg)
        elif conn is None:
            link.send(protocol.Error("say hello first").to_msg())
        elif op in self.rank_ops:
            self.rank_ops[op](conn, msg)
        return op, conn, agent

    def _node_said(self, conn: RankConn, msg: protocol.Message) -> None:
        """A rank's message relayed by its node agent (``node_say``): as from its own connection."""
        if msg["op"] not in protocol.NODE_SAID:
            raise ValueError(f"a node relays no {msg['op']!r} for its ranks")
        self.rank_ops[msg["op"]](conn, msg)

    def _telemetry(self, conn: RankConn, msg: protocol.Message) -> None:
        self._heartbeat(conn, protocol.Heartbeat.from_msg(msg))  # it carries the rank's heartbeat
        batch = TelemetryBatch.from_msg(msg)
        self.diagnosis.telemetry(conn.replica, conn.rank, conn.node, batch)
        self._costs(conn.replica, conn.rank, batch)

    def _quorum(self, conn: RankConn, msg: protocol.Message) -> None:
        conn.last_heartbeat = time.monotonic()
        self.requests.ask(conn, protocol.QuorumAsk.from_msg(msg))

    def _bye(self, conn: RankConn) -> None:
        if conn.finished:
            return
        conn.finished = True
        self.diagnosis.forget(conn.replica)  # its last, half-shipped collective is no hang
        self.events.emit(ev.ReplicaFinished(replica=conn.replica, rank=conn.rank))
        ranks = self.replicas.get(conn.replica, {})
        if len(ranks) == conn.world_size and all(c.finished for c in ranks.values()):
            self.agents.replica_finished(conn.replica)

    def _rank_exited(self, conn: RankConn, msg: protocol.Message) -> None:
        exited = protocol.Exited.from_msg(msg)
        if exited.replica != conn.replica:
            raise ValueError(f"replica {conn.replica} may report only its own exit, not replica {exited.replica}'s")
        self.replica_exited(exited.replica, exited.exitcode)

    def _costs(self, replica: int, rank: int, batch: TelemetryBatch) -> None:
        """A rank's checkpoint and catch-up costs and the corruption it found, into the event log
        (``/metrics`` reads them)."""
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
        for f in batch.sdc:
            self.events.emit(
                ev.SdcDetected(
                    replica=replica,
                    rank=rank,
                    step=f.step,
                    epoch=f.epoch,
                    what=f.what,
                    culprits=f.culprits,
                    committed=f.committed,
                )
            )
        if batch.sdc:
            self.diagnosis.sdc(batch.sdc)

    @staticmethod
    def _heartbeat(conn: RankConn, beat: protocol.Heartbeat) -> None:
        conn.last_heartbeat = time.monotonic()
        if beat.step is not None:
            conn.step = max(conn.step, beat.step)
        if beat.compute_s is not None:
            conn.compute_s = beat.compute_s

    def _hello(self, hello: protocol.Hello, link: protocol.Link) -> RankConn:
        """A rank's own hello: a run of one rank (:meth:`_admit`); raises Refused on a refusal."""
        got = self._admit([RankConn.said_hello(hello, link, time.monotonic())], hello.epoch, True)[0]
        if isinstance(got, Refused):
            raise got
        return got

    def _admit(self, conns: Sequence[RankConn], said: int | None, claims: bool = True) -> list[RankConn | Refused]:
        """Registers ranks of one replica said together through one connection (a node agent's
        hello lists its ranks; :func:`unbroken.control.nodes.node_relay.hello_runs`), each with the same
        world size and saying it trains in epoch ``said`` (``claims``: a claim on the resumed epoch,
        :meth:`_claim_stands`): each rank registered, or refused with why.

        What belongs to the replica (its checks, the welcome's text, its claim on a resumed epoch,
        its connection once every rank is in) is done once for the run, not once per rank: a
        standby taking over registers every rank of the job in one burst."""
        first = conns[0]
        replica, world_size = first.replica, first.world_size
        refused = self._refuse_replica(replica, world_size)
        if refused is not None:
            return [refused] * len(conns)
        ranks = self.replicas.get(replica, {})
        got: list[RankConn | Refused] = []
        now = time.monotonic()
        welcome = b""  # its text, once a rank of the run is in (the heartbeat plan may change first)
        admitted: list[RankConn] = []
        for conn in conns:
            rank = conn.rank
            if rank >= world_size:
                got.append(Refused(f"rank {rank} is not below world_size {world_size}"))
                continue
            if rank in ranks:
                # Refused while the old connection lives: it ends when its process dies, or when it
                # is evicted for silence; the client then reconnects and is served.
                got.append(Refused(f"replica {replica} rank {rank} is already connected: refused until it is gone"))
                continue
            conn.last_heartbeat = now
            ranks = self.replicas.setdefault(replica, ranks)
            ranks[rank] = conn
            if not welcome:
                self._plan_for(world_size)
                welcome = self._welcome(self._store_for(conn.link))
            conn.link.send_payload(welcome)
            admitted.append(conn)
            got.append(conn)
        if not admitted:
            return got
        complete = len(ranks) == world_size
        resumed = self.resumed
        if resumed is not None and claims:
            resumed.hello(admitted, said, complete)
            self.resumed = None if resumed.done else resumed
        if complete:
            self.quorum.connect(replica)
            connected = ev.ReplicaConnected(replica=replica, node=admitted[-1].node, step=admitted[-1].step)
            if resumed is not None:  # every replica of the job at once: logged after the burst of answers
                self.events.emit_soon(connected, after_s=BURST_S)
            else:
                self.events.emit(connected)
        return got

    def _claim(self, conns: Sequence[RankConn], said: int | None) -> None:
        """Ranks registered already say the epoch they train in (their node's hello said again)."""
        resumed = self.resumed
        if resumed is not None and conns:
            complete = len(self.replicas.get(conns[0].replica, {})) == conns[0].world_size
            resumed.hello(conns, said, complete)
            self.resumed = None if resumed.done else resumed

    def _claim_stands(self, run: tuple[Sequence[RankConn], int | None]) -> bool:
        """Whether ranks told beforehand (a standby's :class:`PreSaid`) claim the resumed epoch as
        told: not a member said to train in an older one (or none), told before its relay heard of
        the newer. Its relay says its hello again as it fails over; that claim is made then."""
        resumed, (conns, said) = self.resumed, run
        if resumed is None or not conns:
            return True
        d = resumed.state.decision
        return conns[0].replica not in d.member_set or (said is not None and said >= d.epoch)

    def _refuse_replica(self, replica: int, world_size: int) -> Refused | None:
        """Why no rank of ``replica`` of ``world_size`` ranks may say hello (None: they may)."""
        if replica >= self.settings.total_replicas:
            return Refused(f"replica {replica} is not one of this job's {self.settings.total_replicas} replicas")
        if not 1 <= world_size <= self.settings.max_world_size:
            return Refused(f"world_size must be 1 to {self.settings.max_world_size}, got {world_size}")
        known = next(iter(self.replicas.get(replica, {}).values()), None)  # a replica's ranks share one world_size
        if known is not None and known.world_size != world_size:
            return Refused(f"replica {replica} has ranks of world_size {known.world_size}, not {world_size}")
        return None

    def _plan_for(self, world_size: int) -> None:
        """The heartbeat plan follows the job's size as its registered replicas say it."""
        if world_size != self._planned_for:
            self._planned_for = world_size
            plan = self._plan_heartbeats(self.settings.total_replicas * world_size)
            if plan.period_s > self.beat.period_s:  # only ever slower: a rank told the old period is still in time
                self.beat = plan
        if self._alive_s is None:  # the plan only slows down: the first timeout told is the shortest
            self._alive_s = alive_every(self.beat.timeout_s)

    def _welcome(self, store: str) -> bytes:
        """The welcome's text for ranks given ``store``: the same for every rank while the epoch
        and the heartbeat plan stand (a standby taking over welcomes every rank of the job at once)."""
        key = (store, self.quorum.epoch, self.beat.period_s, self.beat.timeout_s)
        if self._welcomes[0] != key:
            welcome = protocol.Welcome(store=store, epoch=key[1], heartbeat_s=key[2], timeout_s=key[3], term=self.term)
            self._welcomes = (key, protocol.welcome_payload(welcome))
        return self._welcomes[1]

    async def _closed_when_fenced_in(self, conn: RankConn | NodeConn | None, agent: AgentConn | None) -> None:
        """A connection that ended while the lease was lapsed: its eviction once it is valid
        again (cancelled with the tick when the coordinator stops: it stepped down)."""
        while not self.fence():
            await asyncio.sleep(self.TICK_S)
        self._closed(conn, agent)

    def _forgive_deafness(self, now: float) -> None:
        """The lease was lapsed since ``self._fenced_since``: no line was read meanwhile, so that
        silence is nobody's. Every rank's and agent's last sign of life moves on by as much."""
        if self._fenced_since is None:
            return
        deaf, self._fenced_since = now - self._fenced_since, None
        for ranks in self.replicas.values():
            for c in ranks.values():
                c.last_heartbeat = min(now, c.last_heartbeat + deaf)
        for agent in self.agents.agents.values():
            agent.last_heartbeat = min(now, agent.last_heartbeat + deaf)

    def _plan_heartbeats(self, ranks: int) -> HeartbeatPlan:
        s = self.settings
        return plan_heartbeats(ranks, s.heartbeat_s, s.suspect_after_s, s.heartbeat_timeout_s, s.max_heartbeats_per_s)

    def _closed(self, conn: RankConn | NodeConn | None, agent: AgentConn | None) -> None:
        """A connection ended: the rank, node or agent it spoke for is gone."""
        if not self.fence():  # evicting would answer the survivors: once the lease is valid again
            self.fenced_off += 1
            if conn is not None or agent is not None:
                task = asyncio.get_running_loop().create_task(self._closed_when_fenced_in(conn, agent))
                self._closing_fenced.add(task)
                task.add_done_callback(self._closing_fenced.discard)
            return
        if isinstance(conn, NodeConn):
            self.nodes.gone(conn)
        elif conn is not None:
            self._connection_closed(conn)
        if agent is not None:
            self.agents.gone(
                agent, ev.AgentLostCause.CONNECTION_CLOSED, "its connection closed (the agent or its node died)"
            )

    def _connection_closed(self, conn: RankConn) -> None:
        ranks = self.replicas.get(conn.replica, {})
        if ranks.get(conn.rank) is not conn:
            return  # already replaced by a reconnect
        del ranks[conn.rank]
        if not ranks:
            self.replicas.pop(conn.replica, None)
        if conn.finished:
            self.requests.pending.pop(conn.replica, None)
            self.quorum.alive.discard(conn.replica)
            return
        self._evict(
            conn.replica, ev.EvictCause.CONNECTION_CLOSED, "connection closed (process died or lost its network)"
        )

    def _evict(self, replica: int, cause: ev.EvictCause, reason: str) -> None:
        for conn in list(self.replicas.pop(replica, {}).values()):
            conn.link.close()
        self.requests.forget(replica)
        was_member = self.quorum.current is not None and replica in self.quorum.current.member_set
        self.diagnosis.forget(replica)
        self.events.emit(ev.ReplicaEvicted(replica=replica, cause=cause, reason=reason, member=was_member))
        self.requests.deliver(self.quorum.disconnect(replica, time.monotonic()))
        self._push_soon()

    def _push_soon(self) -> None:
        """Has the next epoch pushed once this turn's evictions are done (an agent's loss
        evicts each of its replicas in turn: one pushed epoch for all of them)."""
        if self.requests.push_due:
            return
        self.requests.push_due = True
        try:
            asyncio.get_running_loop().call_soon(self.requests.push_epoch)
        except RuntimeError:  # no loop (a test driving the coordinator by hand): now
            self.requests.push_epoch()

    def _world_size(self, replica: int) -> int | None:
        conns = self.replicas.get(replica, {})
        return next(iter(conns.values())).world_size if conns else None

    def _steps(self, replicas: list[int]) -> dict[str, int]:
        return {
            str(r): max((c.step for c in self.replicas[r].values()), default=0) for r in replicas if r in self.replicas
        }

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
        self.agents.job_failed(stop)

    def _stall_blame(self, epochs: list[int]) -> dict[int, int]:
        """Whom the failed ``epochs``' abandoned collectives point at (:meth:`DiagnosisMaster.stall_blame`)."""
        return self.diagnosis.master.stall_blame(epochs)

    def _store_for(self, link: protocol.Link) -> str:
        """The TCPStore's address as seen by this client (a wildcard bind is no address to dial)."""
        if self.settings.host not in ("0.0.0.0", "::", ""):
            return self.store_address
        host = link.writer.get_extra_info("sockname")[0]
        return f"{host}:{self.store_address.rpartition(':')[2]}"

    # -- the tick --------------------------------------------------------------------------

    async def _tick(self) -> None:
        """Evicts the silent, forms epochs on time, persists: one exception must not end it, or
        a dead replica stays counted as alive and the survivors wait forever."""
        while True:
            await asyncio.sleep(self.TICK_S)
            if not self.fence():
                self.fenced_off += 1
                if self._fenced_since is None:
                    self._fenced_since = time.monotonic()
                continue
            try:
                self._forgive_deafness(time.monotonic())
                self._tick_once(time.monotonic())
            except Exception:
                self.tick_errors += 1
                if self.tick_errors & (self.tick_errors - 1) == 0:  # 1st, 2nd, 4th...: not 20 a second
                    log.exception(
                        "coordinator tick failed (%d so far); the next tick runs all the same", self.tick_errors
                    )

    def _tick_once(self, now: float) -> None:
        if self._grants_lift_at and now >= self._grants_lift_at:
            self._grants_lift_at = 0.0
            self.quorum.lift_grants()
        # Twice the replicas' timeout: an agent's silence costs every replica it runs.
        self.agents.check_silence(now, 2 * self.settings.heartbeat_timeout_s)
        self.agents.check_job_finished()
        suspects = self.quorum.silent & self.quorum.alive
        if now >= self._next_silence_scan:  # a scan of every replica: a fifth of the suspect time is soon enough
            self._next_silence_scan = now + self.beat.suspect_after_s / 5
            suspects = self._scan_silence(now)
        if self.resumed is not None:
            self.resumed.tick(now)
            self.resumed = None if self.resumed.done else self.resumed
        held = self.requests.release_held(now)
        suspects |= held & self.quorum.alive
        if suspects != self.quorum.silent:
            if suspects - self.quorum.silent:
                self.events.emit(
                    ev.ReplicaSilent(replicas=sorted(suspects - self.quorum.silent), after_s=self.beat.suspect_after_s)
                )
            self.requests.deliver(self.quorum.set_silent(suspects, now))
        if len(self.requests.step_times) >= 5:
            self.quorum.join_window_s = min(
                JOIN_WINDOW_MAX_S,
                max(self.settings.join_window_floor_s, 3.0 * statistics.median(self.requests.step_times)),
            )
        self._persist()
        self._say_alive(now)
        self.requests.deliver(self.quorum.evaluate(now))
        self.requests.push_aborts()
        self.diagnosis.tick()
        if self.job_failed is None:
            cur = self.quorum.current
            stop = self.health.check(now, cur.members if cur is not None else ())
            if stop is not None:
                self._fail_job(stop)

    def _say_alive(self, now: float) -> None:
        """Tells the ranks whose requests wait that this coordinator is alive and still holds its
        lease (the tick does not run without it): a rank that hears nothing for
        :func:`~unbroken.control.quorum.heartbeat.silent_after` its welcome's timeout tries the standby,
        so it hears one six times within that (:func:`~unbroken.control.quorum.heartbeat.alive_every`).
        Only waiting ranks: an answered step costs no line."""
        if now < self._next_alive:
            return
        self._next_alive = now + (self._alive_s or ALIVE_S)
        for waiting in (self.requests.pending, self.requests.held):
            for ranks in waiting.values():
                for conn, *_ in ranks.values():
                    conn.link.send_payload(protocol.ALIVE)

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
