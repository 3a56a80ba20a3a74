"""A node's ranks through one connection: the coordinator's side of node aggregation (issue 31).

At 100,000 ranks a connection per rank makes the coordinator's load the rank count: a line, a
MAC and a system call per rank per step, each way. A node agent instead speaks for its node's
ranks through one authenticated connection (``node_hello``, then ``node_quorum`` and
``node_heartbeat`` lines carrying every rank's request or beat, ``node_say`` lines carrying
what else they say: their flight-recorder batches, their goodbyes), and hears back one
``node_answers`` line per node per burst, whose messages it fans out to its ranks. The
operations are :data:`unbroken.control.protocol.messages.MESSAGES`' node directions; the agent's side is
:mod:`unbroken.launch.node.relay`.

A node is bound to its own ranks: one live connection speaks for a node name (another is refused
until it is gone), and a rank whose replica the agents' placement puts on other nodes is refused
(alone), so one node's connection cannot take over ranks placed elsewhere.

Each rank spoken for still has its own :class:`~unbroken.control.quorum.service.RankConn`, whose
link is a :class:`NodeLink`: what the coordinator sends a rank (its welcome, its quorum answer,
an abort) is queued on the node's connection, and everything queued in one turn of the event
loop leaves as one line. So the quorum service and the rest of the coordinator keep their
per-rank bookkeeping unchanged, and a node's eight answers cost one line. A node speaks only
for the ranks it said hello for; a request for any other is not acted on, and that rank is
reported ``dropped`` (as its own connection closing would have told it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from unbroken.config import is_loopback
from unbroken.control import protocol
from unbroken.control.protocol.messages import MAX_NODE_RANKS
from unbroken.control.protocol.serving import Refused
from unbroken.control.quorum.service import RankConn
from unbroken.wire import jsontext

log = logging.getLogger("unbroken.control.coordinator")  # the coordinator's log

MAX_ANSWER_LINE = protocol.MAX_LINE // 2  # a node_answers line is split before it nears the reader's limit
# How long an adopted node's welcome waits at most for the answers to the line it said already
# (NodeRelay.adopt): within the silence a rank allows its coordinator (heartbeat.silent_after).
ADOPTED_WELCOME_S = 1.0

Slot = tuple[int, int]  # (replica, rank)
WILDCARD_HOSTS = ("0.0.0.0", "::")  # a store bound to every interface names no address to dial


def slot_json(slot: Slot) -> bytes:
    """A slot as the JSON text of a ``node_answers`` line's ``to`` (made once per rank, not per answer)."""
    return b"[%d,%d]" % slot


class NodeConn:
    """One node agent's connection and the ranks it speaks for."""

    def __init__(self, node: str, link: protocol.Link) -> None:
        self.node, self.link = node, link
        self.store = ""  # the rendezvous store its agent hosts, as its groups use it (usable_store)
        self.ranks: dict[Slot, RankConn] = {}
        # What this turn of the loop sent its ranks (NodeLink.send_payload): (the rank's slot_json,
        # the message's JSON text), one node_answers line at the end of the turn.
        self.outbox: list[tuple[bytes, bytes]] = []
        self._dropped: list[Slot] = []
        self._flushing = False
        self.deferred = False  # adopted: its welcomes wait for its first line's answers (NodeRelay.adopt)

    def drop(self, slot: Slot) -> None:
        """The rank ``slot`` is no longer heard through this node: the agent is told."""
        self.ranks.pop(slot, None)
        self._dropped.append(slot)
        self.schedule()

    def hold(self) -> bool:
        """Holds what is queued until the caller flushes (True), unless a flush is due already (False)."""
        if self._flushing:
            return False
        self._flushing = True
        return True

    def schedule(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Sends what was queued as ``node_answers`` lines (one, unless it would be too long)."""
        self._flushing = self.deferred = False
        outbox, dropped = self.outbox, self._dropped
        self.outbox, self._dropped = [], []
        if not outbox and not dropped:  # flushed already, at the end of the node's own line
            return
        if sum(len(p) for _, p in outbox) + 16 * len(outbox) < MAX_ANSWER_LINE:  # the common case: one line
            self.link.send_payload(answers_payload(outbox, dropped))
            return
        while outbox or dropped:
            size, n = 0, 0
            while n < len(outbox) and (n == 0 or size + len(outbox[n][1]) < MAX_ANSWER_LINE):
                size += len(outbox[n][1]) + 16
                n += 1
            batch, outbox = outbox[:n], outbox[n:]
            self.link.send_payload(answers_payload(batch, dropped))
            dropped = []


def usable_store(store: str, coordinator_host: str) -> str:
    """``store``, announced by a node's agent, if every member can dial it: a loopback or wildcard
    host only while the coordinator listens on loopback too (the whole job on one machine). Else
    "": the groups that node leads meet on the coordinator's store. (An agent that reached the
    coordinator through loopback, on the coordinator's own node, advertises loopback.)"""
    host = store.rpartition(":")[0].strip("[]")
    if (is_loopback(host) or host in WILDCARD_HOSTS) and not is_loopback(coordinator_host):
        return ""
    return store


def answers_payload(batch: list[tuple[bytes, bytes]], dropped: list[Slot]) -> bytes:
    """The JSON text of a :class:`~unbroken.control.protocol.messages.NodeAnswers` whose ranks
    (:func:`slot_json`) and messages are already encoded (a full quorum answer's text is shared
    by many ranks: it is not parsed again).

    A text told to several ranks in a row (the same object: a node's ranks are told alike, as
    an epoch pushed after a death or a welcome) goes once, with ``runs`` saying for how many:
    at 12,500 nodes a push was 100,000 copies of the same answer, written, sealed and parsed."""
    to = b",".join(s for s, _ in batch)
    gone = b",".join(slot_json(s) for s in dropped)
    texts: list[bytes] = []
    runs: list[int] = []
    for _, payload in batch:
        if texts and payload is texts[-1]:
            runs[-1] += 1
        else:
            texts.append(payload)
            runs.append(1)
    op, msgs = protocol.NodeAnswers.OP.encode(), b",".join(texts)
    if len(texts) == len(batch):
        return b'{"op":"%s","to":[%s],"msgs":[%s],"dropped":[%s]}' % (op, to, msgs, gone)
    counts = b",".join(b"%d" % n for n in runs)
    return b'{"op":"%s","to":[%s],"msgs":[%s],"runs":[%s],"dropped":[%s]}' % (op, to, msgs, counts, gone)


def kept_answer(conn: RankConn) -> None:
    """A rank spoken for through a connection its relay kept across a takeover holds the last full
    answer of the epoch it trains in (its client's connection to the relay never ended): when
    this coordinator continues that epoch, the rank is answered short in it, as the last one would
    have (:class:`~unbroken.control.protocol.messages.QuorumSame`), and told to abort it if it is given up."""
    if conn.trains is not None:
        conn.epoch = conn.trains


def hello_runs(hellos: Sequence[protocol.Hello]) -> list[list[protocol.Hello]]:
    """A node's hellos as runs of ranks of one replica saying the same world size and epoch: what
    is the replica's is then checked and done once per run (a node of one replica group: one run)."""
    runs: list[list[protocol.Hello]] = []
    for h in hellos:
        last = runs[-1][0] if runs else None
        if last is not None and last.replica == h.replica and last.world_size == h.world_size and last.epoch == h.epoch:
            runs[-1].append(h)
        else:
            runs.append([h])
    return runs


Built = tuple[list[RankConn], int | None]  # a run's rank connections, and the epoch its hellos say


def built_runs(node: NodeConn, hello: protocol.NodeHello, now: float) -> list[Built]:
    """The rank connections of ``hello``'s ranks through ``node``, by run (:func:`hello_runs`), to
    be registered (:meth:`NodeRelay.admit`): built apart from registering, so that a standby builds
    them from a node's hello said before it takes over (:class:`PreSaid`)."""
    runs: list[Built] = []
    for run in hello_runs(hello.ranks):
        conns = [
            RankConn.said_hello(h, NodeLink(node, (h.replica, h.rank)), now, node.store, relayed=True) for h in run
        ]
        runs.append((conns, run[0].epoch))
    return runs


Run = tuple[int, protocol.QuorumAsk, list[int]]  # (replica, its request, the ranks asking it)


def replica_runs(asks: tuple[tuple[int, int, protocol.QuorumAsk], ...]) -> list[Run]:
    """A node line's requests as runs of one replica asking one request: (replica, request, ranks).

    An agent lists a replica's ranks together, asking alike (:class:`protocol.NodeQuorum` parses
    equal requests into one object), so a node of one replica group is one run: the quorum service
    then takes the replica's request once (:meth:`QuorumService.ask_ranks`), not once per rank.
    """
    runs: list[Run] = []
    for replica, rank, ask in asks:
        if runs and runs[-1][0] == replica and (runs[-1][1] is ask or runs[-1][1] == ask):
            runs[-1][2].append(rank)
        else:
            runs.append((replica, ask, [rank]))
    return runs


class NodeLink(protocol.Link):
    """A rank's link through its node's connection: what is sent to it is queued on the node's."""

    __slots__ = ("node", "slot", "closed", "to")

    def __init__(self, node: NodeConn, slot: Slot) -> None:  # noqa: D107 -- no Link.__init__: no stream of its own
        parent = node.link
        self.reader, self.writer, self.session = parent.reader, parent.writer, parent.session
        self.sent = self.received = 0
        self.node, self.slot, self.closed, self.to = node, slot, False, slot_json(slot)

    def send(self, msg: protocol.Message) -> None:
        self.send_payload(jsontext.dumps(msg))

    def send_payload(self, payload: bytes) -> None:
        # No check of the node's stream here: its flush (Link.send_payload) drops what a closed one cannot send.
        if not self.closed:
            node = self.node
            node.outbox.append((self.to, payload))
            if not node._flushing:
                node.schedule()
            self.sent += 1

    def flush(self) -> None:
        """Sends what the node's connection holds now, as one ``node_answers`` line."""
        if self.node._flushing:
            self.node.flush()

    def close(self) -> None:
        """The coordinator ends this rank's connection (an eviction): the node is told, the rest of
        its ranks stay connected."""
        if not self.closed:
            self.closed = True
            if self.node.ranks.get(self.slot) is not None and self.node.ranks[self.slot].link is self:
                self.node.drop(self.slot)


@dataclasses.dataclass(frozen=True)
class RelayHooks:
    """The coordinator's per-rank operations a node connection is served with: its doors, named.

    Attributes:
        admit: registers rank connections of one replica said together (a run of
            :func:`built_runs`), saying the epoch given (claimed for the resumed epoch unless told
            not to), as their own hellos would: each rank's connection, or the exception it is
            refused with.
        quorum: the same quorum request of ranks of one replica (:meth:`QuorumService.ask_ranks`).
        closed: one rank's connection ended (it is evicted unless it finished).
        said: one rank's other message (one of :data:`~unbroken.control.protocol.messages.NODE_SAID`), as
            its own connection would have said it; None: ignored.
        claim: ranks registered already say (again) the epoch they train in: a hello said
            beforehand and read once the standby serves; None: ignored.
        elsewhere: why a node may not speak for a replica's ranks (placed on other nodes), None
            when it may (:meth:`~unbroken.control.nodes.agents.NodeAgents.elsewhere`); None: any.
    """

    admit: Callable[[Sequence[RankConn], int | None, bool], Sequence[RankConn | Exception]]
    quorum: Callable[[list[RankConn], protocol.QuorumAsk], None]
    closed: Callable[[RankConn], None]
    said: Callable[[RankConn, protocol.Message], None] | None = None
    claim: Callable[[Sequence[RankConn], int | None], None] | None = None
    elsewhere: Callable[[int, str], str | None] | None = None


class NodeRelay:
    """The coordinator's handling of node connections, given its per-rank operations.

    Args:
        hooks: the coordinator's per-rank operations (:class:`RelayHooks`).
        coordinator_host: the host the coordinator listens on: a node's store on loopback is used
            only when it is on loopback too (:func:`usable_store`).
    """

    def __init__(self, hooks: RelayHooks, coordinator_host: str = "127.0.0.1") -> None:
        self.hooks = hooks
        self.coordinator_host = coordinator_host
        self._warned = False  # of a store other nodes cannot dial: once
        self.connected: set[NodeConn] = set()  # the node connections served now (``unbroken status``)
        self.by_node: dict[str, NodeConn] = {}  # the one live connection speaking for each node name
        self.handlers: dict[str, Callable[[NodeConn, protocol.Message], None]] = {
            protocol.NodeHello.OP: lambda node, msg: self.hello(node, protocol.NodeHello.from_msg(msg)),
            protocol.NodeHeartbeat.OP: lambda node, msg: self._beats(node, protocol.NodeHeartbeat.from_msg(msg)),
            protocol.NodeQuorum.OP: lambda node, msg: self._asks(node, protocol.NodeQuorum.from_msg(msg)),
            protocol.NodeSay.OP: lambda node, msg: self._says(node, protocol.NodeSay.from_msg(msg)),
            protocol.NodeLeave.OP: lambda node, msg: self._leave(node, protocol.NodeLeave.from_msg(msg)),
        }

    def open(self, hello: protocol.NodeHello, link: protocol.Link) -> NodeConn:
        """A connection's first ``node_hello``: the node connection, with the ranks it speaks for.

        Raises:
            Refused: another live connection speaks for that node (its agent reconnected before
                the old connection was seen to end: it is served once that one is gone).
        """
        if hello.node in self.by_node:
            raise Refused(
                f"node {hello.node!r} is spoken for by another live connection: refused until it is gone "
                "(give each agent its own --node)"
            )
        node = NodeConn(hello.node, link)
        self.connected.add(node)
        self.by_node[node.node] = node
        node.hold()  # its ranks' welcomes leave at the end of the hello, as answers do (handle)
        try:
            self.hello(node, hello)
        except Exception:
            self.gone(node)
            raise
        node.flush()
        return node

    def adopt(
        self, node: NodeConn, runs: list[Built], speaking: bool = False, stands: Callable[[Built], bool] | None = None
    ) -> None:
        """A node connection whose ranks were built before this coordinator served (a standby's
        :class:`PreSaid`): registered now, each rank welcomed, as if its hello had just come.

        ``speaking``: its welcomes wait for the answers to a line of its own (its relay moved onto
        this connection when the active coordinator's ended, and says the requests that wait), one
        line each way in the takeover's burst, or :data:`ADOPTED_WELCOME_S` at the longest. Else
        they leave now: the welcome is how a relay learns of a takeover from an active coordinator
        that hangs (its lease lapsed; its connection does not end).
        ``stands``: whether a run's epoch is claimed as told (else it is when the node says it
        again, :meth:`hello`)."""
        self.connected.add(node)
        self.by_node[node.node] = node
        node.hold()
        node.deferred = speaking
        try:
            self._register(node, runs, stands)
            for conn in node.ranks.values():
                kept_answer(conn)
        finally:
            if speaking:
                asyncio.get_running_loop().call_later(ADOPTED_WELCOME_S, self._welcome_adopted, node)
            else:
                node.flush()

    @staticmethod
    def _welcome_adopted(node: NodeConn) -> None:
        if node.deferred:
            node.flush()

    def status(self) -> dict[str, int]:
        """The ranks each node connection speaks for now, by node."""
        return {node.node: len(node.ranks) for node in sorted(self.connected, key=lambda n: n.node)}

    def hello(self, node: NodeConn, hello: protocol.NodeHello) -> None:
        if hello.node != node.node:
            raise ValueError(f"this connection speaks for node {node.node!r}, not {hello.node!r}")
        new = [h for h in hello.ranks if (h.replica, h.rank) not in node.ranks] if hello.beforehand else hello.ranks
        if len(node.ranks) + len(new) > MAX_NODE_RANKS:
            raise ValueError(f"a node connection speaks for at most {MAX_NODE_RANKS} ranks")
        if hello.store:
            node.store = usable_store(hello.store, self.coordinator_host)
            if not node.store and not self._warned:
                self._warned = True
                log.warning(
                    "node %s announced the rendezvous store %s, which other nodes cannot dial: the groups "
                    "it leads meet on the coordinator's store (give its agent --advertise-addr)",
                    node.node,
                    hello.store,
                )
        if hello.beforehand:  # said to a standby, read once it serves: the ranks it holds say their epoch again
            held = [h for h in hello.ranks if (h.replica, h.rank) in node.ranks]
            for run in hello_runs(held):
                conns = [node.ranks[(h.replica, h.rank)] for h in run]
                for conn, h in zip(conns, run, strict=True):
                    conn.step = max(conn.step, h.step)
                if self.hooks.claim is not None:
                    self.hooks.claim(conns, run[0].epoch)
                    for conn in conns:
                        kept_answer(conn)
            hello = dataclasses.replace(hello, ranks=tuple(new))
            if not hello.ranks:
                return
        self._register(node, built_runs(node, hello, time.monotonic()))

    def _register(self, node: NodeConn, runs: list[Built], stands: Callable[[Built], bool] | None = None) -> None:
        for conns, said in runs:
            why = self.hooks.elsewhere(conns[0].replica, node.node) if self.hooks.elsewhere is not None else None
            if why is not None:  # another node's ranks: each refused alone, as a rank held already
                for conn in conns:
                    conn.link.send(protocol.Error(why).to_msg())
                    if (conn.replica, conn.rank) not in node.ranks:
                        node.drop((conn.replica, conn.rank))
                continue
            claims = stands is None or stands((conns, said))
            for conn, got in zip(conns, self.hooks.admit(conns, said, claims), strict=True):
                slot = (conn.replica, conn.rank)
                if isinstance(got, RankConn):
                    node.ranks[slot] = got
                else:  # that rank alone: its node's other ranks are not refused with it
                    conn.link.send(protocol.Error(str(got)).to_msg())
                    if slot not in node.ranks:  # a slot said twice: the one this node holds stays
                        node.drop(slot)

    def handle(self, node: NodeConn, op: str, msg: protocol.Message) -> None:
        handler = self.handlers.get(op)
        if handler is None:
            raise ValueError(f"a node connection does not say {op!r}")
        # What its ranks are told while the node's own line is handled (its answers) leaves at
        # the end of the line, not in a callback of its own: one turn of the loop less per node.
        held = node.hold()
        try:
            handler(node, msg)
        finally:
            if held or node.deferred:
                node.flush()

    def _asks(self, node: NodeConn, asks: protocol.NodeQuorum) -> None:
        now = time.monotonic()
        for replica, ask, ranks in replica_runs(asks.asks):
            conns = []
            for rank in ranks:
                conn = node.ranks.get((replica, rank))
                if conn is None:  # not one of its ranks (or one evicted a moment ago): it is told
                    node.drop((replica, rank))
                    continue
                conn.last_heartbeat = now  # a request is a sign of life, as a heartbeat
                conns.append(conn)
            if conns:
                self.hooks.quorum(conns, ask)

    def _beats(self, node: NodeConn, beats: protocol.NodeHeartbeat) -> None:
        now = time.monotonic()
        for beat in beats.beats:
            conn = node.ranks.get(beat[:2])
            if conn is not None:
                conn.last_heartbeat = now
                conn.step = conn.step if beat[2] is None else max(conn.step, beat[2])
                if len(beat) == 4 and beat[3] is not None:
                    conn.compute_s = beat[3]

    def _says(self, node: NodeConn, says: protocol.NodeSay) -> None:
        """Each rank's message as from its own connection: a malformed one is that rank's error
        (told to it, as its own connection would be), not the node's."""
        for replica, rank, msg in says.says:
            conn = node.ranks.get((replica, rank))
            if conn is None:
                node.drop((replica, rank))
                continue
            if self.hooks.said is None:
                raise ValueError("this coordinator takes no node_say")
            try:
                self.hooks.said(conn, msg)
            except (ValueError, TypeError, KeyError, OverflowError) as e:
                conn.link.send(protocol.Error(f"malformed message skipped: {e}").to_msg())

    def _leave(self, node: NodeConn, leave: protocol.NodeLeave) -> None:
        for slot in leave.ranks:
            conn = node.ranks.pop(slot, None)
            if conn is not None:
                self.hooks.closed(conn)

    def gone(self, node: NodeConn) -> None:
        """The node's connection ended: every rank it spoke for is gone with it."""
        self.connected.discard(node)
        if self.by_node.get(node.node) is node:
            del self.by_node[node.node]
        ranks, node.ranks = node.ranks, {}
        for conn in ranks.values():
            self.hooks.closed(conn)


class PreSaid:
    """The node hellos a standby was told before it took over, built into rank connections.

    A node agent's relay says its node's ``node_hello`` on its warm connection to the standby
    (:mod:`unbroken.launch.node.relay`) when that connection is made, and again when it changes (a
    rank that came or went, the epoch its ranks train in). The standby, holding the connection
    (:meth:`~unbroken.control.protocol.serving.ConnectionServer.hold`), keeps the latest one, parsed and
    built into the node's rank connections (:func:`built_runs`), and registers them all when it
    takes over (:meth:`NodeRelay.adopt`), before it reads any line: in the takeover's burst, each
    node then sends only its pending requests. At 12,500 nodes the hellos were half of the
    standby's burst (docs/benchmarks/2026-11-28-takeover-registration.md).

    Only a ``node_hello`` said ``beforehand`` is kept (another line is held as before, a hello said
    to reach a coordinator too); one per node, the latest, forgotten when its connection ends (or
    the node says it on another); a malformed one is not kept.
    """

    def __init__(self, coordinator_host: str) -> None:
        self.coordinator_host = coordinator_host
        self.nodes: dict[protocol.Link, tuple[NodeConn, list[Built]]] = {}
        self.links: dict[str, protocol.Link] = {}  # the connection each node said its hello on last

    def said(self, link: protocol.Link, msg: protocol.Message) -> bool:
        """Keeps ``msg`` if it is a node's hello (True); False: a line to hold until the takeover."""
        if msg.get("op") != protocol.NodeHello.OP or msg.get("beforehand") is not True:
            return False  # a hello said to reach a coordinator: held, and refused if none takes over
        try:
            hello = protocol.NodeHello.from_msg(msg)
        except (ValueError, TypeError, KeyError):
            return False
        node = NodeConn(hello.node, link)
        node.store = usable_store(hello.store, self.coordinator_host) if hello.store else ""
        older = self.links.get(hello.node)
        if older is not None and older is not link:  # a connection of the node's agent before this one, open still
            self.nodes.pop(older, None)
        self.links[hello.node] = link
        self.nodes[link] = (node, built_runs(node, hello, time.monotonic()))
        return True

    def forget(self, link: protocol.Link) -> None:
        """The connection ended before the takeover."""
        kept = self.nodes.pop(link, None)
        if kept is not None and self.links.get(kept[0].node) is link:
            del self.links[kept[0].node]

    def adopt(
        self,
        relay: NodeRelay,
        speaking: dict[protocol.Link, protocol.Message | ValueError] | None = None,
        stands: Callable[[Built], bool] = lambda run: True,
        died: bool = False,
    ) -> dict[protocol.Link, NodeConn]:
        """Registers every node kept (:meth:`NodeRelay.adopt`); returns who each connection speaks
        for from now on. Emptied: what a node says from here on is served as any line.

        ``speaking``: the held connections' lines that wait to be served. One that is a hello said
        beforehand is taken as such, first, and removed: a relay whose node changed since it last
        told the standby says its whole hello again as it fails over, and that one stands (its
        ranks' epochs above all: a stale one would give up the resumed epoch for every replica).
        ``died``: the active coordinator died (it did not hang): every relay moves over by itself,
        and each node's welcomes wait for the answers to its own line.
        A run that does not ``stand`` (it says an epoch older than the one resumed: told before its
        relay heard of the newer) is registered without its claim on the resumed epoch: its relay
        says its hello again as it fails over, and that claim is made then (or the replica is not
        back in time, and is evicted)."""
        speaking = {} if speaking is None else speaking
        for link, msg in list(speaking.items()):
            if not isinstance(msg, ValueError) and self.said(link, msg):
                del speaking[link]
        adopted: dict[protocol.Link, NodeConn] = {}
        nodes, self.nodes, self.links = self.nodes, {}, {}
        for link, (node, runs) in nodes.items():
            try:
                relay.adopt(node, runs, died or link in speaking, stands)
            except Exception:  # a bug: that node reconnects and says hello, as to any coordinator
                log.exception("the hello node %s said before the takeover could not be registered", node.node)
                relay.gone(node)
                link.close()
                continue
            adopted[link] = node
        return adopted
