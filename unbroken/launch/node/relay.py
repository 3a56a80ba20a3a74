"""A node agent's relay: the node's ranks reach the coordinator through one connection (issue 31).

With a connection per rank, the coordinator's load is the job's rank count: a line, a MAC and a
system call per rank per step, each way. The agent (``unbroken agent``) listens on loopback and
gives its ranks ``UNBROKEN_COORDINATOR=<this listener>,<the coordinator's addresses>``; the rank's
client tries them in turn, so it needs no change: it speaks the same ``hello``, ``quorum``,
``heartbeat``, ``telemetry`` and ``bye`` lines to the relay and reads the same ``welcome``,
``quorum``, ``epoch``, ``abort`` lines back. The relay speaks for them upstream through one node
connection (:mod:`unbroken.control.nodes.node_relay` is the coordinator's side):

- a rank's hello becomes its ``node_hello``; the quorum requests that arrive in one turn of the
  event loop share one ``node_quorum`` line (a request waits for no other rank: what arrives
  together goes together, nothing is held back for a batch); a closed rank connection becomes a
  ``node_leave`` (the coordinator evicts its replica, as for its own connection);
- a rank's flight-recorder batch, its goodbye (and an exit it reports) go in ``node_say`` lines
  (the batches ride with the next line that goes anyway, or the next heartbeat tick);
- its heartbeats are folded into one ``node_heartbeat`` per period, for the ranks heard since the
  last one and not mentioned in a line since (a rank that went silent is not vouched for: the
  coordinator still evicts a hung rank);
- each message of a ``node_answers`` line is written to its rank's connection unchanged; a
  ``dropped`` rank's connection is closed, and its client reconnects and says hello again.

Ranks are admitted and authenticated exactly as the coordinator admits them (the same
:class:`~unbroken.control.protocol.serving.ConnectionServer`, the job's secret, the ``coordinator``
purpose: to a rank, the relay *is* a coordinator address, and both sides' fresh nonces make a
handshake with one listener worthless at another). Nothing a rank sends is trusted: each message
is parsed into its typed form (:mod:`unbroken.control.protocol.messages`) before it is relayed, a rank
connection speaks only for the (replica, rank) it said hello as, and every queue is bounded.

Failure, by design: the ranks are the agent's children and die with it (``kill -9`` of the
agent loses the node, as without the relay). If the relay's own code fails while the agent
lives, it closes its listener and every rank connection: each rank's client moves to the next
address, the coordinator's, and is served on its own connection, as without the relay.

Given a standby (a second address), the relay keeps an idle, authenticated connection to it,
which the standby holds without answering until it takes over
(:meth:`~unbroken.control.protocol.serving.ConnectionServer.hold`), and says the node's hello on it
beforehand (``node_hello`` with ``beforehand``: every rank it speaks for, at its step and in the
epoch it trains), and again a while after that changes (:data:`RESAY_S`). The standby registers
those ranks the moment it takes over (:class:`~unbroken.control.nodes.node_relay.PreSaid`). So a takeover
costs no handshake and no hello: when the node connection is lost (the active coordinator died),
or the standby's welcome comes on that connection (the active one hangs, its lease lapsed), the
relay moves onto it with every rank connection kept, and their grants: it says only what the
standby was not told (the node's hello again if it changed since, a leave for a rank gone) and
each request that waits (each waiting rank is told ``alive``, so that none gives up on the
coordinator meanwhile). At 12,500 nodes the hellos were half of the standby's takeover
(docs/benchmarks/2026-11-28-takeover-presaid.md). Without a standby told, a lost node connection
closes every rank connection: each client reconnects (to the relay first), says its own hello
and re-sends what it waits for, exactly as after a lost coordinator connection, and the relay
says ``node_hello`` again for them on its next node connection. A client that waits longer than
it allows a silent coordinator (1.5 s) moves on to the coordinator directly.

:class:`RelayBook` is the bookkeeping, pure (no I/O); :class:`Relay` is the asyncio shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any

from unbroken import config as env
from unbroken.control import protocol
from unbroken.control.client import StaleTerm
from unbroken.control.protocol.messages import MAX_NODE_RANKS
from unbroken.control.protocol.serving import ConnectionServer, Refused
from unbroken.control.quorum.grants import Grant
from unbroken.control.quorum.rules import QuorumDecision, push_answers
from unbroken.diagnosis.telemetry import TelemetryBatch
from unbroken.wire.auth import JobSecret

log = logging.getLogger(__name__)

Slot = tuple[int, int]  # (replica, rank)

# A rank's line, wrapped in a node line, must stay under the coordinator's MAX_LINE: the relay
# reads its ranks' lines with this much less room (a telemetry batch is kilobytes, not a megabyte).
MARGIN = 4096
MAX_SAY_BYTES = protocol.MAX_LINE // 2  # a node_say line is split before it nears MAX_LINE
MAX_QUEUED = 16 * MAX_NODE_RANKS  # items waiting for the node connection (a rank past it is closed)
MAX_RANK_BACKLOG = 8 << 20  # bytes queued to a rank that does not read: its connection is closed
WARM_RETRY_S = 5.0  # how soon a warm connection to the standby that failed or ended is tried again
# How long after the node changed (a rank came or went, its epoch) the standby is told again: at
# random within, past the push of an epoch (0.9 s at 12,500 nodes), so that the standby's 12,500
# hellos do not take CPU from it. A failover within it says the whole hello first (failover).
RESAY_S = (1.0, 3.0)
DEFAULT_HEARTBEAT_S = 0.1  # the client's own default, until a welcome says the coordinator's


def first_warm_wait(failover: bool, rng: random.Random | None = None) -> float:
    """Seconds before a relay first reaches for the standby after its node connection is made:
    none at the start; after a failover, one to two :data:`WARM_RETRY_S`, at random.

    After a failover the next address is most likely the coordinator just lost, and every relay
    of the job failed over in the same instant: at once, 12,500 of them reached for it while the
    new coordinator served them (on the 2-core bench, their futile connects took CPU from the
    takeover), and they would reach for it again in one burst once it restarts as the standby.
    Not before the takeover's burst is over: a coordinator restarted as the standby takes
    seconds to be up in any case.
    """
    if not failover:
        return 0.0
    draw = random.uniform if rng is None else rng.uniform
    return draw(WARM_RETRY_S, 2 * WARM_RETRY_S)


class Overloaded(Exception):
    """More is queued for the node connection than :data:`MAX_QUEUED`."""


@dataclasses.dataclass(eq=False)
class RankLine:
    """One rank's connection to the relay, and the (replica, rank) it said hello as, for good."""

    hello: protocol.Hello
    link: Any  # the rank's protocol.Link (opaque here: the book does no I/O)
    announced: bool = False  # its hello went up on the current node connection
    heard: bool = True  # it said something the coordinator has not heard of since
    step: int | None = None
    compute_s: float | None = None
    grant: Grant | None = None  # the coordinator's fast answer standing for its next steps
    trains: int | None = None  # the epoch it trains in: its hello's, then the last answered or pushed to it
    pending: protocol.QuorumAsk | None = None  # its request sent upstream and not answered yet

    @property
    def slot(self) -> Slot:
        return (self.hello.replica, self.hello.rank)


class RelayBook:
    """Which rank connection speaks for which slot, and what goes up the node connection next.

    What the ranks say is queued in order, as (kind, rank, item); :meth:`lines` turns each run
    of one kind into one node line, so that a rank's hello always precedes its requests and a
    rank's leave precedes the hello of its next connection.
    """

    def __init__(
        self, node: str, max_ranks: int = MAX_NODE_RANKS, max_queued: int = MAX_QUEUED, store: str = ""
    ) -> None:
        self.node, self.max_ranks, self.max_queued = node, max_ranks, max_queued
        self.store = store  # the rendezvous store the agent hosts, said in every node_hello
        self.ranks: dict[Slot, RankLine] = {}
        self.heartbeat_s = DEFAULT_HEARTBEAT_S
        self.term: int | None = None  # the newest lease term a coordinator welcomed this node's ranks in
        self.urgent = False  # something queued must go this turn (more than telemetry)
        self.answered = 0  # requests answered here, within a grant (unbroken.control.quorum.grants)
        # What the standby was told of this node (standby_hello): each slot and the epoch it said.
        self.presaid: dict[Slot, int | None] | None = None
        self.stale = False  # the node changed since: the standby is told again
        self._queue: list[tuple[str, RankLine | None, Any]] = []

    def hello(self, link: Any, hello: protocol.Hello) -> RankLine:
        """A rank's hello (already parsed): its connection now speaks for that slot alone.

        Raises:
            ValueError: the slot is held by another live connection here, or the node is full.
        """
        hello = dataclasses.replace(hello, node=self.node)
        slot = (hello.replica, hello.rank)
        if slot in self.ranks:
            raise ValueError(
                f"replica {hello.replica} rank {hello.rank} is already connected through node "
                f"{self.node!r}: refused until that connection is gone"
            )
        if len(self.ranks) >= self.max_ranks:
            raise ValueError(f"node {self.node!r} relays at most {self.max_ranks} ranks")
        rank = RankLine(hello, link, step=hello.step, trains=hello.epoch)
        self.ranks[slot] = rank
        self._put("hello", rank, hello)
        return rank

    def said(self, rank: RankLine, msg: protocol.Message) -> bytes | None:
        """One message of a rank that said hello, validated into its typed form and queued; or,
        a quorum request within the rank's grant, answered: the answer's text is returned.

        Raises:
            ValueError (or TypeError, KeyError): a malformed message, or one a rank does not say.
            Overloaded: too much waits for the node connection.
        """
        if self.ranks.get(rank.slot) is not rank:
            return None  # dropped a moment ago: its connection is closing
        op = msg["op"]
        if op == protocol.QuorumAsk.OP:
            ask = protocol.QuorumAsk.from_msg(msg)
            grant = rank.grant
            if grant is not None and grant.answers(ask.step, ask.failed_epoch):
                rank.heard, rank.step = True, max(rank.step or 0, ask.step)  # its next heartbeat says so
                self.answered += 1
                return protocol.same_payload(ask.id, grant.epoch, ask.step)
            rank.grant = None
            self._put("ask", rank, ask)
            rank.pending = ask
        elif op == protocol.Heartbeat.OP:
            self._note(rank, protocol.Heartbeat.from_msg(msg))
        elif op == protocol.Telemetry.OP:
            beat = protocol.Heartbeat.from_msg(msg)
            batch = TelemetryBatch.from_msg(msg)
            self._note(rank, beat)
            self._put("say", rank, protocol.Telemetry(beat, batch.to_msg()).to_msg(), urgent=False)
        elif op == protocol.Bye.OP:
            self._put("say", rank, protocol.Bye().to_msg())
        elif op == protocol.Exited.OP:
            exited = protocol.Exited.from_msg(msg)
            if exited.replica != rank.hello.replica:
                raise ValueError(
                    f"replica {rank.hello.replica} may report only its own exit, not replica {exited.replica}'s"
                )
            self._put("say", rank, exited.to_msg())
        elif op == protocol.Hello.OP:
            raise ValueError("a connection speaks for one rank: it said hello already")
        else:
            raise ValueError(f"a rank says no {op!r} to its node's relay")
        return None

    def _note(self, rank: RankLine, beat: protocol.Heartbeat) -> None:
        rank.heard = True
        if beat.step is not None:
            rank.step = max(rank.step or 0, beat.step)
        if beat.compute_s is not None:
            rank.compute_s = beat.compute_s

    def _put(self, kind: str, rank: RankLine, item: Any, urgent: bool = True) -> None:
        if len(self._queue) >= self.max_queued:
            raise Overloaded(f"more than {self.max_queued} messages wait for the coordinator")
        self._queue.append((kind, rank, item))
        self.urgent = self.urgent or urgent

    def gone(self, rank: RankLine) -> None:
        """The rank's connection closed: the node says so (if its hello went up at all)."""
        if self.ranks.get(rank.slot) is not rank:
            return
        del self.ranks[rank.slot]
        if rank.announced:  # what it said before it closed goes first (a goodbye, above all)
            self._queue.append(("leave", rank, rank.slot))
            self.urgent = self.stale = True
        else:
            self._queue = [q for q in self._queue if q[1] is not rank]

    def lines(self) -> list[protocol.Message]:
        """The node lines to send now: one per run of one kind in the queue (split only at
        :data:`MAX_NODE_RANKS` items, or a node_say at :data:`MAX_SAY_BYTES`)."""
        queue, self._queue, self.urgent = self._queue, [], False
        out: list[protocol.Message] = []
        kind, size = "", 0
        run: list[tuple[RankLine | None, Any]] = []
        for k, rank, item in queue:
            cost = len(str(item)) if k == "say" else 0  # a bound, not the exact JSON length
            if run and (k != kind or k == "node" or len(run) >= MAX_NODE_RANKS or size + cost > MAX_SAY_BYTES):
                out.append(self._line(kind, run))
                run, size = [], 0
            kind, size = k, size + cost
            if rank is None:
                pass
            elif k == "hello":
                rank.announced = True
                self.stale = True
            elif k != "leave":
                rank.heard = False  # the coordinator hears of it from this line
            run.append((rank, item))
        if run:
            out.append(self._line(kind, run))
        return out

    def _line(self, kind: str, run: list[tuple[RankLine | None, Any]]) -> protocol.Message:
        if kind == "hello":
            return protocol.NodeHello(node=self.node, ranks=tuple(item for _, item in run), store=self.store).to_msg()
        if kind == "ask":
            return protocol.NodeQuorum(asks=tuple((*r.slot, item) for r, item in run if r is not None)).to_msg()
        if kind == "say":
            return protocol.NodeSay(says=tuple((*r.slot, item) for r, item in run if r is not None)).to_msg()
        if kind == "node":
            msg: protocol.Message = run[0][1]
            return msg
        return protocol.NodeLeave(ranks=tuple(item for _, item in run)).to_msg()

    def beats(self) -> protocol.Message | None:
        """One ``node_heartbeat`` for the ranks heard since the coordinator last heard of them."""
        heard = [r for r in self.ranks.values() if r.heard and r.announced]
        for r in heard:
            r.heard = False
        if not heard:
            return None
        return protocol.NodeHeartbeat(beats=tuple((*r.slot, r.step, r.compute_s) for r in heard)).to_msg()

    def fan_out(self, answers: protocol.NodeAnswers) -> tuple[list[tuple[RankLine, protocol.Message]], list[RankLine]]:
        """Who gets which message of a ``node_answers`` line, and which connections to close.

        A message for a rank no longer here is for nobody (its client reconnects and asks
        again). A ``dropped`` rank is forgotten (the coordinator forgot it already: no leave is
        said); a hello not yet sent is no rank the coordinator could have dropped, and stays.
        """
        out = []
        for slot, msg in zip(answers.to, answers.msgs, strict=True):
            rank = self.ranks.get(slot)
            if rank is None or not rank.announced:
                continue
            op = msg["op"]
            if op == protocol.Welcome.OP:
                welcome = protocol.Welcome.from_msg(msg)
                if welcome.term is not None:
                    if self.term is not None and welcome.term < self.term:
                        raise StaleTerm(
                            f"a welcome of term {welcome.term}, older than term {self.term} this node was answered in"
                        )
                    self.term = welcome.term
                if welcome.heartbeat_s:  # the coordinator's pace: the node beats at it too
                    self.heartbeat_s = min(max(welcome.heartbeat_s, 0.05), 5.0)
            if op == protocol.QuorumSame.OP and "decision" not in msg:
                same = protocol.QuorumSame.from_msg(msg)
                rank.grant = Grant.from_answer(same.same_epoch, same.step, same.through)
                self._answered(rank, same.id, same.same_epoch)
            elif op not in (protocol.Alive.OP, protocol.Donate.OP, protocol.Prepare.OP, protocol.Error.OP):
                rank.grant = None  # a full answer, a pushed epoch, an abort: the coordinator decides again
                if op == protocol.QuorumAnswer.OP:
                    self._answered(rank, protocol.count(msg, "id"), protocol.count(msg["decision"], "epoch"))
                elif op == protocol.EpochPush.OP:
                    self._pushed(rank, protocol.EpochPush.from_msg(msg).decision)
            out.append((rank, msg))
        dropped = []
        for slot in answers.dropped:
            rank = self.ranks.get(slot)
            if rank is not None and rank.announced:
                del self.ranks[slot]
                self._queue = [q for q in self._queue if q[1] is not rank]
                dropped.append(rank)
                self.stale = True
        return out, dropped

    def _answered(self, rank: RankLine, answer_id: int, epoch: int) -> None:
        """The rank was answered in ``epoch``, its request ``answer_id`` with it."""
        if rank.pending is not None and rank.pending.id == answer_id:
            rank.pending = None
        self._trains(rank, epoch)

    def _pushed(self, rank: RankLine, decision: dict[str, Any]) -> None:
        """An epoch pushed to the rank: the answer to its request for that very step (else it asks
        on: kept, the request is said again after a failover; a stale one is only answered twice)."""
        d = QuorumDecision.from_json(decision)
        ask = rank.pending
        if ask is not None and push_answers(d, rank.hello.replica, ask.step, ask.failed_epoch):
            rank.pending = None  # as the rank's client takes it (control.client)
        self._trains(rank, d.epoch)

    def _trains(self, rank: RankLine, epoch: int) -> None:
        if rank.trains != epoch:
            rank.trains = epoch
            self.stale = True  # the epoch its hello says, which a standby resumes (control.resume)

    def standby_hello(self) -> protocol.Message | None:
        """This node's hello for the standby, said before it takes over: every rank announced upstream,
        at its step and in the epoch it trains (None: no rank yet). Noted as what the standby was told."""
        ranks = sorted(
            (r for r in self.ranks.values() if r.announced), key=lambda r: r.slot
        )  # by replica: one run each
        self.presaid = {r.slot: r.trains for r in ranks}
        self.stale = False
        if not ranks:
            return None
        hellos = tuple(dataclasses.replace(r.hello, step=r.step or 0, epoch=r.trains) for r in ranks)
        return protocol.NodeHello(node=self.node, ranks=hellos, store=self.store, beforehand=True).to_msg()

    def failover(self) -> list[RankLine]:
        """The node connection moves to the standby this node's hello was said to (:attr:`presaid`):
        every rank stays connected, and keeps its grant (the standby resumes the epoch granted, and
        admits no newcomer until every grant of the coordinator it took over from has run out:
        :meth:`~unbroken.control.quorum.rules.QuorumState.resume`). What the standby was not told goes
        first: the node's whole hello if a rank came or its epoch changed since (the standby takes
        it as it takes over, in place of the one said). Then what the ranks said that was not
        sent (a goodbye before its rank's leave), a leave for each rank gone since it was told,
        and each request that waits, said again. Returns the ranks whose request waits."""
        presaid, self.presaid = self.presaid or {}, None
        queue, self._queue = self._queue, []
        if {slot: r.trains for slot, r in self.ranks.items()} != presaid:
            for r in self.ranks.values():
                r.announced = True
            whole = self.standby_hello()
            if whole is not None:
                self._queue.append(("node", None, whole))
            self.presaid = None
        self._queue += [q for q in queue if q[0] == "say"]
        self._queue += [("leave", None, slot) for slot in presaid if slot not in self.ranks]
        waiting = [r for r in self.ranks.values() if r.pending is not None]
        self._queue += [("ask", r, r.pending) for r in waiting]
        for r in self.ranks.values():
            r.announced = True
        self.urgent = bool(self._queue)
        self.stale = False
        return waiting

    def reset(self) -> list[RankLine]:
        """The node connection is gone: every rank connection is to be closed (each client
        reconnects, says its own hello and re-sends what it waits for), nothing queued is sent."""
        ranks, self.ranks, self._queue, self.urgent = list(self.ranks.values()), {}, [], False
        self.presaid, self.stale = None, False
        return ranks


class Relay:
    """The I/O around a :class:`RelayBook`: the loopback listener and the node connection.

    Args:
        node: this node's name (the agent's ``--node``).
        coordinator: the coordinator's ``HOST:PORT[,HOST:PORT...]`` (the active one and standbys).
        secret: the job's secret.
        on_fail: told why, once, if the relay's own code failed and it stopped (see the module).
        store: the ``HOST:PORT`` of the rendezvous store the agent hosts for the cross-replica
            groups led from this node ("" for none: they meet on the coordinator's).
    """

    def __init__(
        self,
        node: str,
        coordinator: str,
        secret: JobSecret,
        on_fail: Callable[[str], None] | None = None,
        hello_timeout_s: float = 10.0,
        store: str = "",
    ) -> None:
        self.book = RelayBook(node, store=store)
        self.addresses = env.parse_host_ports(coordinator, "--coordinator")
        self.secret, self.on_fail = secret, on_fail
        self.server: ConnectionServer[RankLine, None] = ConnectionServer(
            secret, MAX_NODE_RANKS, hello_timeout_s, self._dispatch, self._closed, what="the node relay"
        )
        self.failed: str | None = None
        self.connections = 0  # node connections made (the first, and one per reconnect)
        self._up: protocol.Link | None = None
        self._listener: asyncio.base_events.Server | None = None
        self._wanted = asyncio.Event()  # a rank waits to be announced: the node connection is needed
        self._flush_due = False
        self._next = 0  # the coordinator address tried next
        self._tasks: list[asyncio.Task[None]] = []
        self._warm: tuple[int, protocol.Link] | None = None  # (address index, an idle link to the standby)
        self._warming: asyncio.Task[None] | None = None
        self.warm_used = 0  # node connections that were the standby's warm one
        self.kept = 0  # failovers to the standby with every rank connection kept
        self._presaid_on: protocol.Link | None = None  # the warm link the node's hello was said on
        self._resay: asyncio.TimerHandle | None = None  # the standby is told the node's hello again then
        self._taken: protocol.Message | None = None  # the standby's first line on the warm link: it took over

    @property
    def address(self) -> str:
        assert self._listener is not None, "call start() first"
        host, port = self._listener.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> str:
        """Listens on loopback; returns the address the node's ranks are given first."""
        self._listener = await asyncio.start_server(self.server.serve, "127.0.0.1", 0, limit=protocol.MAX_LINE - MARGIN)
        self._tasks = [
            asyncio.create_task(self._guard(self._upstream())),
            asyncio.create_task(self._guard(self._beat())),
        ]
        return self.address

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._shut()

    def _cool(self) -> None:
        if self._resay is not None:
            self._resay.cancel()
            self._resay = None
        if self._warming is not None:
            self._warming.cancel()
            self._warming = None
        if self._warm is not None:
            self._warm[1].close()
            self._warm = None

    def fail(self, why: str) -> None:
        """The relay stops for good; its ranks move to the coordinator's own address."""
        if self.failed is not None:
            return
        self.failed = why
        log.error("the node relay failed (%s): its ranks reconnect to the coordinator directly", why)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self._shut()
        if self.on_fail is not None:
            self.on_fail(why)

    def _shut(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self.server.close_all()  # every rank connection: each client moves to the next address
        if self._up is not None:
            self._up.close()
        self._cool()

    async def _guard(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here: the ranks are better served directly than not at all
            log.exception("the node relay's loop failed")
            self.fail(f"{type(e).__name__}: {e}")

    # -- the ranks' side ------------------------------------------------------------------

    def _dispatch(
        self, msg: protocol.Message, link: protocol.Link, rank: RankLine | None, _: None
    ) -> tuple[str, RankLine | None, None]:
        if self.failed is not None:
            return "stop", rank, None
        op = msg["op"]
        try:
            if rank is None:
                if op != protocol.Hello.OP:
                    link.send(protocol.Error("say hello first").to_msg())
                    return op, None, None
                try:
                    rank = self.book.hello(link, protocol.Hello.from_msg(msg))
                except (ValueError, TypeError) as e:
                    raise Refused(str(e)) from e
                self._wanted.set()
            else:
                answer = self.book.said(rank, msg)
                if answer is not None:
                    link.send_payload(answer)
        except Overloaded as e:
            raise Refused(str(e)) from e
        if self.book.urgent:
            self._schedule()
        return op, rank, None

    def _closed(self, rank: RankLine | None, _: None) -> None:
        if rank is not None:
            self.book.gone(rank)
            if self.book.urgent:
                self._schedule()
            self._mind_standby()

    def _to_rank(self, rank: RankLine, msg: protocol.Message) -> None:
        link: protocol.Link = rank.link
        if link.writer.transport.get_write_buffer_size() > MAX_RANK_BACKLOG:
            log.warning("replica %d rank %d reads nothing: its connection is closed", *rank.slot)
            link.close()
            return
        link.send(msg)

    # -- the node connection --------------------------------------------------------------

    def _schedule(self) -> None:
        """Sends what is queued at the end of this turn of the loop: what arrived together goes together."""
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._up is None:
            return  # kept for the node connection, being made
        for line in self.book.lines():
            self._up.send(line)
        self._mind_standby()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.book.heartbeat_s)
            if self._up is not None:
                self._flush()  # the flight-recorder batches waiting for a line
                beat = self.book.beats()
                if beat is not None:
                    self._up.send(beat)

    def _mind_standby(self) -> None:
        """Has the standby told the node's hello again a while after it changed (:data:`RESAY_S`)."""
        warm = self._warm
        if self.book.stale and self._resay is None and warm is not None and warm[1] is self._presaid_on:
            self._resay = asyncio.get_running_loop().call_later(random.uniform(*RESAY_S), self._resay_now)

    def _resay_now(self) -> None:
        self._resay = None
        warm = self._warm
        if warm is not None and warm[1] is self._presaid_on and self.book.stale:
            self._presay(warm[1])

    def _presay(self, link: protocol.Link) -> None:
        hello = self.book.standby_hello()
        self._presaid_on = link
        if hello is not None:
            link.send(hello)

    async def _connect(self) -> protocol.Link:
        warm, self._warm = self._warm, None
        if self._warming is not None:
            self._warming.cancel()  # it waits on the link's first line: nothing is lost
            await asyncio.wait([self._warming])  # and no longer reads when this one does
            self._warming = None
        if warm is not None and not warm[1].writer.is_closing():
            self._next = warm[0]
            self.warm_used += 1
            return warm[1]
        while True:
            host, port = self.addresses[self._next % len(self.addresses)]
            try:
                reader, writer, session = await protocol.connect_async(host, port, self.secret, timeout=5.0)
                return protocol.Link(reader, writer, session)
            except (OSError, asyncio.TimeoutError) as e:
                log.debug("the node relay could not reach the coordinator at %s:%d: %s", host, port, e)
                self._next += 1
                if self._next % len(self.addresses) == 0:
                    await asyncio.sleep(0.1)

    async def _upstream(self) -> None:
        while True:
            await self._wanted.wait()
            link = await self._connect()
            self._up = link
            self.connections += 1
            if len(self.addresses) > 1:
                wait = first_warm_wait(failover=self.connections > 1)
                self._warming = asyncio.create_task(self._keep_warm((self._next + 1) % len(self.addresses), wait))
            try:
                taken, self._taken = self._taken, None
                if taken is not None:  # the standby's welcome that told the relay it took over
                    self._answer_msg(taken)
                self._flush()
                with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                    while (line := await link.readline()) is not None:
                        self._answer(link, line)
            finally:
                self._up = None
                link.close()
                self._fail_over()

    def _fail_over(self) -> None:
        """The node connection is gone. Onto a standby told this node's hello: every rank stays
        connected (those waiting for an answer are told the coordinator is alive, so that none
        gives up on it while the standby takes over). Else each rank connection is closed: each
        client reconnects, says hello and re-sends what it waits for."""
        warm = self._warm
        if warm is not None and warm[1] is self._presaid_on and self.book.presaid is not None:
            if not warm[1].writer.is_closing():
                self.kept += 1
                for rank in self.book.failover():
                    rank.link.send_payload(protocol.ALIVE)
                self._wanted.set()
                return
        for rank in self.book.reset():  # each reconnects, and is announced again
            rank.link.close()
        self._wanted.clear()

    async def _keep_warm(self, index: int, wait: float = 0.0) -> None:
        """Holds an idle, authenticated connection to address ``index`` (the standby) for the next
        node connection, first tried ``wait`` seconds from now; one that fails or ends is tried
        again after :data:`WARM_RETRY_S`."""
        host, port = self.addresses[index]
        if wait:
            await asyncio.sleep(wait)
        while True:
            try:
                reader, writer, session = await protocol.connect_async(host, port, self.secret, timeout=5.0)
            except (OSError, asyncio.TimeoutError) as e:  # AuthError is a ConnectionError
                log.debug("no warm connection to the standby at %s:%d: %s", host, port, e)
            else:
                link = protocol.Link(reader, writer, session)
                self._warm = (index, link)
                self._presay(link)
                line = None
                with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
                    line = await link.readline()  # a standby says nothing until it takes over
                if line is not None and self._took_over(link, line):
                    return
                self._warm = None
                link.close()
            await asyncio.sleep(WARM_RETRY_S)

    def _took_over(self, link: protocol.Link, line: bytes) -> bool:
        """The standby's first line: it took over (its welcome of the node's ranks, said beforehand),
        whether or not the active one's connection ended (it hangs: its lease lapsed). The node
        connection moves onto this one. False: not a welcome (a refusal), the link is dropped."""
        try:
            msg = link.decode(line)
        except (ValueError, ConnectionError):  # malformed, or forged (AuthError)
            return False
        msgs = msg.get("msgs") if msg.get("op") == protocol.NodeAnswers.OP else None
        if not isinstance(msgs, list) or not any(
            isinstance(m, dict) and m.get("op") == protocol.Welcome.OP for m in msgs
        ):
            return False  # a welcome of the node's ranks, not an answer to the hello (the same coordinator twice)
        self._taken = msg
        up, self._up = self._up, None  # nothing more is sent there (what is queued goes to this one)
        if up is not None:
            up.close()  # its read ends: the node connection fails over onto this one
        else:
            self._wanted.set()
        return True

    def _answer(self, link: protocol.Link, line: bytes) -> None:
        try:
            msg = link.decode(line)  # AuthError (a ConnectionError): the node connection ends
        except ValueError as e:
            log.warning("malformed line from the coordinator skipped (%s): %r", e, line[:80])
            return
        self._answer_msg(msg)

    def _answer_msg(self, msg: protocol.Message) -> None:
        try:
            if msg["op"] == protocol.Error.OP:
                log.warning("the coordinator: %s", protocol.Error.from_msg(msg).message)
                return
            if msg["op"] != protocol.NodeAnswers.OP:
                raise ValueError(f"a node connection is answered with node_answers, not {msg['op']!r}")
            out, dropped = self.book.fan_out(protocol.NodeAnswers.from_msg(msg))
        except StaleTerm as e:  # a replaced coordinator: nothing it says is passed on
            log.warning("%s: leaving it", e)
            up, self._up = self._up, None
            if up is not None:
                up.close()
            return
        except (ValueError, TypeError, KeyError) as e:
            log.warning("malformed line from the coordinator skipped (%s): %.80r", e, msg)
            return
        for rank, m in out:
            self._to_rank(rank, m)
        for rank in dropped:
            rank.link.close()
        self._mind_standby()
