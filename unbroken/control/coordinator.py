"""The coordinator service: membership, quorum epochs, pushed aborts, persisted history.

A thin asyncio shell around :mod:`unbroken.control.quorum`. Each rank of each replica keeps one
TCP connection open (see :mod:`unbroken.control.protocol`); a closed connection or a process
exit reported by the supervisor evicts the replica at once, a silent one is evicted when its
heartbeats stop. The coordinator also hosts the ``torch.distributed`` TCPStore on which the
cross-replica groups of every epoch rendezvous.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import contextlib
import dataclasses
import logging
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from unbroken.control import protocol
from unbroken.control.assignment import Assignment
from unbroken.control.quorum import QuorumDecision, QuorumRequest, QuorumRules, QuorumState
from unbroken.config import ENV_ANOMALY_POLICY
from unbroken.diagnosis.master import DiagnosisMaster
from unbroken.diagnosis.metrics import parse_policy
from unbroken.diagnosis.service import DiagnosisService
from unbroken.control.state_store import KEEP_EVENTS, StateStore
from unbroken.observe.events import EventLog

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


# A connection that sends this many malformed messages is not a replica gone astray: it is closed.
MAX_BAD_MESSAGES = 100


@dataclasses.dataclass
class _RankConn:
    replica: int
    rank: int
    world_size: int
    writer: asyncio.StreamWriter
    transfer_addr: str
    pid: int
    node: str
    last_heartbeat: float
    step: int = 0
    finished: bool = False
    compute_s: float | None = None  # the rank's own compute time last step, from heartbeats


@dataclasses.dataclass
class _AgentConn:
    """A node agent's connection: while it is open, the agent runs its replicas."""

    node: str
    writer: asyncio.StreamWriter
    pid: int
    last_heartbeat: float


class Coordinator:
    """One job's coordinator. Use ``await start()``, then ``address``; ``await stop()``."""

    TICK_S = 0.05

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        policy = parse_policy(settings.anomaly_policy or os.environ.get(ENV_ANOMALY_POLICY, ""))
        self.store = StateStore(settings.state_dir, settings.journal_mode, settings.keep_events)
        try:
            self.events = EventLog(Path(settings.state_dir) / "events.jsonl", "coordinator")
        except BaseException:
            self.store.close()
            raise
        self.events.subscribe(self.store.record_event)
        self.diagnosis = DiagnosisService(self.events, DiagnosisMaster(policy=policy))
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
        self.agents: dict[str, _AgentConn] = {}
        self.finished: set[int] = set()
        self._first_finish: float | None = None
        self._job_finished_sent = False
        self._aborted: dict[int, int] = {}
        self._hinted: dict[int, int] = {}  # newcomer -> the epoch in which its donor was told
        self._server: asyncio.base_events.Server | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._tcp_store: Any = None
        self.store_address = ""
        if first_epoch:
            self.events.emit("coordinator_restarted", continue_after_epoch=first_epoch)

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
        from unbroken.wire.auth import JobSecret
        from unbroken.wire.store import StoreServer

        # The groups' rendezvous store: authenticated, and bound to the coordinator's host only.
        secret = getattr(self, "secret", None) or JobSecret.required()
        self._tcp_store = StoreServer(self.settings.host, secret)
        self.store_address = self._tcp_store.address
        try:
            self._server = await asyncio.start_server(
                self._serve, self.settings.host, self.settings.port, limit=protocol.MAX_LINE
            )
        except OSError as e:
            raise OSError(
                f"the coordinator cannot listen on {self.settings.host}:{self.settings.port}: "
                f"{e.strerror}; pick another port with --port (0 picks a free one)"
            ) from e
        self._tick_task = asyncio.create_task(self._tick())
        self.events.emit("coordinator_started", address=self.address, store=self.store_address)

    async def stop(self) -> None:
        if self._tick_task:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
        if self._server:
            self._server.close()
            for ranks in self.replicas.values():
                for conn in ranks.values():
                    conn.writer.close()
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
            self._evict(replica, f"process exited with code {exitcode}")

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
            "verdicts": self.diagnosis.status(),
        }

    # -- connections -----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn: _RankConn | None = None
        agent: _AgentConn | None = None
        bad = 0
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    msg = protocol.decode(line)
                    kind, conn, agent = self._dispatch(msg, writer, conn, agent)
                except Exception as e:
                    # A malformed message is skipped, and the connection keeps serving; only a
                    # flood of them ends it.
                    bad += 1
                    if isinstance(e, (ValueError, TypeError, KeyError, OverflowError)):
                        log.debug("malformed message skipped: %s", e)
                    else:
                        log.exception("a message could not be handled; skipped")
                    self._send(writer, {"op": "error", "message": f"malformed message skipped: {e}"})
                    if bad >= MAX_BAD_MESSAGES:
                        break
                    continue
                if kind == "stop":
                    break
        except (ConnectionError, ValueError, asyncio.IncompleteReadError) as e:
            log.debug("connection ended: %s", e)
        finally:
            writer.close()
            if conn is not None:
                self._connection_closed(conn)
            if agent is not None:
                self._agent_gone(agent, "its connection closed (the agent or its node died)")

    def _dispatch(self, msg: dict[str, Any], writer: asyncio.StreamWriter, conn: _RankConn | None,
                  agent: _AgentConn | None) -> tuple[str, _RankConn | None, _AgentConn | None]:
        """Acts on one message; raises ValueError (or TypeError, KeyError) on a malformed one."""
        op = msg["op"]
        if op == "agent_hello":
            agent = self._agent_hello(msg, writer)
            if agent is None:
                return "stop", conn, agent
        elif op == "agent_heartbeat" and agent is not None:
            self._agent_heartbeat(agent)
        elif op == "hello":
            conn = self._hello(msg, writer)
        elif op == "status":
            self._send(writer, {"op": "status", **self.status()})
        elif op == "exited":
            self.replica_exited(protocol.count(msg, "replica"), msg.get("exitcode"))
        elif conn is None:
            self._send(writer, {"op": "error", "message": "say hello first"})
        elif op == "heartbeat":
            step = protocol.count(msg, "step", conn.step)
            compute_s = protocol.seconds(msg, "compute_s", conn.compute_s)
            conn.last_heartbeat = time.monotonic()
            conn.step, conn.compute_s = step, compute_s
        elif op == "telemetry":
            conn.last_heartbeat = time.monotonic()
            self.diagnosis.telemetry(conn.replica, conn.rank, conn.node, msg)
        elif op == "quorum":
            conn.last_heartbeat = time.monotonic()
            self._quorum_request(conn, msg)
        elif op == "bye":
            conn.finished = True
            self.diagnosis.forget(conn.replica)  # its last, half-shipped collective is no hang
            self.events.emit("replica_finished", replica=conn.replica, rank=conn.rank)
            self._replica_done(conn)
        return op, conn, agent

    def _hello(self, msg: dict[str, Any], writer: asyncio.StreamWriter) -> _RankConn:
        conn = _RankConn(
            replica=int(msg["replica"]),
            rank=int(msg["rank"]),
            world_size=int(msg["world_size"]),
            writer=writer,
            transfer_addr=str(msg.get("transfer_addr", "")),
            pid=int(msg.get("pid", 0)),
            node=str(msg.get("node", "")),
            last_heartbeat=time.monotonic(),
            step=int(msg.get("step", 0)),
        )
        ranks = self.replicas.setdefault(conn.replica, {})
        old = ranks.get(conn.rank)
        if old is not None and old.writer is not writer:
            old.writer.close()
        ranks[conn.rank] = conn
        self.diagnosis.hello(conn.replica, conn.rank, conn.pid, str(msg.get("stack_file", "")),
                             msg.get("stack_signal"))
        self._send(writer, {"op": "welcome", "store": self._store_for(writer), "epoch": self.quorum.epoch})
        if len(ranks) == conn.world_size:
            self.quorum.connect(conn.replica)
            self.events.emit(
                "replica_connected", replica=conn.replica, node=conn.node, pid=conn.pid, step=conn.step
            )
        return conn

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
        self._evict(conn.replica, "connection closed (process died or lost its network)")

    def _evict(self, replica: int, reason: str) -> None:
        for conn in list(self.replicas.pop(replica, {}).values()):
            conn.writer.close()
        self.pending.pop(replica, None)
        was_member = self.quorum.current is not None and replica in self.quorum.current.members
        self.diagnosis.forget(replica)
        self.events.emit("replica_evicted", replica=replica, reason=reason, member=was_member)
        self._deliver(self.quorum.disconnect(replica, time.monotonic()))
        self._push_aborts()

    # -- node agents -----------------------------------------------------------------------

    def _agent_hello(self, msg: dict[str, Any], writer: asyncio.StreamWriter) -> _AgentConn | None:
        node = str(msg.get("node", ""))
        try:
            busy = {r for r, conns in self.replicas.items() if conns}
            replicas = self.assignment.join(node, int(msg.get("slots", 1)),
                                            running=[int(r) for r in msg.get("running", [])], busy=busy)
        except ValueError as e:
            self._send(writer, {"op": "error", "message": str(e)})
            return None
        agent = _AgentConn(node=node, writer=writer, pid=int(msg.get("pid", 0)), last_heartbeat=time.monotonic())
        self.agents[node] = agent
        self.events.emit("agent_joined", node=node, slots=self.assignment.slots[node], replicas=replicas,
                         pid=agent.pid)
        self._send(writer, {"op": "assign", "replicas": replicas, "num_replicas": self.settings.total_replicas})
        return agent

    def _agent_heartbeat(self, agent: _AgentConn) -> None:
        agent.last_heartbeat = time.monotonic()
        steps = {str(r): max((c.step for c in self.replicas[r].values()), default=0)
                 for r in self.assignment.replicas_of(agent.node) if r in self.replicas}
        self._send(agent.writer, {"op": "agent_status", "steps": steps})

    def _agent_gone(self, agent: _AgentConn, reason: str) -> None:
        """All of the agent's replicas are gone with it: evict them now, move them to spare slots."""
        if self.agents.get(agent.node) is not agent:
            return
        del self.agents[agent.node]
        agent.writer.close()
        lost, moves = self.assignment.leave(agent.node, done=self.finished)
        self.events.emit("agent_lost", node=agent.node, replicas=lost, reason=reason)
        for r in lost:
            if r not in self.finished and (r in self.quorum.alive or r in self.replicas):
                self._evict(r, f"its agent on node {agent.node} is gone: {reason}")
        for node, replicas in moves.items():
            for r in replicas:
                self.events.emit("replica_reassigned", replica=r, from_node=agent.node, to_node=node)
            self._send(self.agents[node].writer, {"op": "assign", "replicas": replicas,
                                                  "num_replicas": self.settings.total_replicas})
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
        if not late and any(r not in self.finished for r in self.assignment.owner):
            return
        self._job_finished_sent = True
        self.events.emit("job_finished", finished=sorted(self.finished))
        for agent in self.agents.values():
            self._send(agent.writer, {"op": "job_finished"})

    def _store_for(self, writer: asyncio.StreamWriter) -> str:
        """The TCPStore's address as seen by this client (a wildcard bind is no address to dial)."""
        if self.settings.host not in ("0.0.0.0", "::", ""):
            return self.store_address
        host = writer.get_extra_info("sockname")[0]
        return f"{host}:{self.store_address.rpartition(':')[2]}"

    # -- quorum ----------------------------------------------------------------------------

    def _quorum_request(self, conn: _RankConn, msg: dict[str, Any]) -> None:
        step_time = protocol.seconds(msg, "step_time", None)
        step = protocol.count(msg, "step")
        req_id = protocol.count(msg, "id")
        failed = msg.get("failed_epoch")
        failed = None if failed is None else protocol.count(msg, "failed_epoch")
        if step_time:
            self.step_times.append(step_time)
        conn.step = step
        ranks = self.pending.setdefault(conn.replica, {})
        ranks[conn.rank] = (conn, req_id, conn.step, failed)
        if len(ranks) < conn.world_size:
            return
        del self.pending[conn.replica]
        failures = [f for (_, _, _, f) in ranks.values() if f is not None]
        req = QuorumRequest(
            replica=conn.replica,
            step=min(s for (_, _, s, _) in ranks.values()),
            failed_epoch=max(failures) if failures else None,
        )
        if req.failed_epoch is not None:
            self.events.emit("exchange_failed", replica=req.replica, epoch=req.failed_epoch, step=req.step)
        answer, formed = self.quorum.request(req, time.monotonic())
        if answer is not None:
            self._reply(answer, {req.replica: ranks})
        else:
            self.pending[conn.replica] = ranks
        self._deliver(formed)
        self._push_aborts()
        self._hint_donors()

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
            self.events.emit("donor_told", newcomer=joiner, donor=donor, epoch=epoch)
            for conn in self.replicas.get(donor, {}).values():
                self._send(conn.writer, {"op": "donate", "to": joiner})

    def _deliver(self, decisions: list[QuorumDecision]) -> None:
        for d in decisions:
            self.store.record_epoch(d.epoch, d.step, list(d.members), list(d.behind))
            self.events.emit(
                "quorum", epoch=d.epoch, step=d.step, members=list(d.members),
                behind=list(d.behind), donors=[list(p) for p in d.donors],
            )
            waiting = {m: self.pending.pop(m) for m in d.members if m in self.pending}
            self._reply(d, waiting)

    def _reply(
        self, d: QuorumDecision, waiting: dict[int, dict[int, tuple[_RankConn, int, int, int | None]]]
    ) -> None:
        for ranks in waiting.values():
            for rank, (conn, req_id, _, _) in ranks.items():
                addrs = {
                    str(m): self.replicas[m][rank].transfer_addr
                    for m in d.members
                    if m in self.replicas and rank in self.replicas[m]
                }
                self._send(
                    conn.writer,
                    {"op": "quorum", "id": req_id, "decision": d.to_json(), "transfer_addrs": addrs,
                     "store": self._store_for(conn.writer)},
                )

    def _push_aborts(self) -> None:
        cur = self.quorum.current
        if cur is None:
            return
        for replica in self.quorum.in_flight_members():
            if self._aborted.get(replica) == cur.epoch:
                continue
            self._aborted[replica] = cur.epoch
            for conn in self.replicas.get(replica, {}).values():
                self._send(conn.writer, {"op": "abort", "epoch": cur.epoch})

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
                    log.exception("coordinator tick failed (%d so far); the next tick runs all the same",
                                  self.tick_errors)

    def _tick_once(self, now: float) -> None:
        for agent in list(self.agents.values()):
            if now - agent.last_heartbeat > 2 * self.settings.heartbeat_timeout_s:
                self._agent_gone(agent, f"no heartbeat for {2 * self.settings.heartbeat_timeout_s:.1f}s")
        self._check_job_finished()
        suspects = set()
        for replica, ranks in list(self.replicas.items()):
            if any(c.finished for c in ranks.values()):
                continue
            quiet = max((now - c.last_heartbeat for c in ranks.values()), default=0.0)
            if quiet > self.settings.heartbeat_timeout_s:
                self._evict(replica, f"no heartbeat for {self.settings.heartbeat_timeout_s:.1f}s (hung or stopped)")
            elif quiet > self.settings.suspect_after_s:
                suspects.add(replica)
        if suspects != self.quorum.silent:
            if suspects - self.quorum.silent:
                self.events.emit("replica_silent", replicas=sorted(suspects - self.quorum.silent),
                                 after_s=self.settings.suspect_after_s)
            self._deliver(self.quorum.set_silent(suspects, now))
        if len(self.step_times) >= 5:
            self.quorum.join_window_s = max(
                self.settings.join_window_floor_s, 3.0 * statistics.median(self.step_times)
            )
        self._persist()
        self._deliver(self.quorum.evaluate(now))
        self._push_aborts()
        self.diagnosis.tick()

    def _persist(self) -> None:
        """Has the writer thread reserve epochs ahead of the ones issued and write the queued
        history; the limit on new epochs rises once the reservation is on disk."""
        if self._persisting is not None and not self._persisting.done():
            return
        self._persisting = asyncio.get_running_loop().run_in_executor(
            self._writer, self.store.persist, self.quorum.epoch)
        self._persisting.add_done_callback(self._persisted)

    def _persisted(self, done: asyncio.Future[int]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.quorum.epoch_limit = done.result()

    @staticmethod
    def _send(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
        if not writer.is_closing():
            writer.write(protocol.encode(msg))
