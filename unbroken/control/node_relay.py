"""A node's ranks through one connection: the coordinator's side of node aggregation (issue 31).

At 100,000 ranks a connection per rank makes the coordinator's load the rank count: a line, a
MAC and a system call per rank per step, each way. A node agent instead speaks for its node's
ranks through one authenticated connection (``node_hello``, then ``node_quorum`` and
``node_heartbeat`` lines carrying every rank's request or beat, ``node_say`` lines carrying
what else they say: their flight-recorder batches, their goodbyes), and hears back one
``node_answers`` line per node per burst, whose messages it fans out to its ranks. The
operations are :data:`unbroken.control.messages.MESSAGES`' node directions; the agent's side is
:mod:`unbroken.launch.relay`.

Each rank spoken for still has its own :class:`~unbroken.control.quorum_service.RankConn`, whose
link is a :class:`NodeLink`: what the coordinator sends a rank (its welcome, its quorum answer,
an abort) is queued on the node's connection, and everything queued in one turn of the event
loop leaves as one line. So the quorum service and the rest of the coordinator keep their
per-rank bookkeeping unchanged, and a node's eight answers cost one line. A node speaks only
for the ranks it said hello for; a request for any other is not acted on, and that rank is
reported ``dropped`` (as its own connection closing would have told it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from unbroken.control import protocol
from unbroken.control.messages import MAX_NODE_RANKS
from unbroken.control.quorum_service import RankConn

MAX_ANSWER_LINE = protocol.MAX_LINE // 2  # a node_answers line is split before it nears the reader's limit

Slot = tuple[int, int]  # (replica, rank)
_SAME_KEYS = protocol.QuorumSame(id=0, same_epoch=0, step=0).to_msg().keys()
_SAME = b'{"op":"%s","id":%%d,"same_epoch":%%d,"step":%%d}' % protocol.QuorumSame.OP.encode()


class NodeConn:
    """One node agent's connection and the ranks it speaks for."""

    def __init__(self, node: str, link: protocol.Link) -> None:
        self.node, self.link = node, link
        self.ranks: dict[Slot, RankConn] = {}
        self._outbox: list[tuple[Slot, bytes]] = []
        self._dropped: list[Slot] = []
        self._flushing = False

    def queue(self, slot: Slot, payload: bytes) -> None:
        """``payload`` (a message's JSON text) for the rank ``slot``: sent with this turn's others."""
        self._outbox.append((slot, payload))
        self._schedule()

    def drop(self, slot: Slot) -> None:
        """The rank ``slot`` is no longer heard through this node: the agent is told."""
        self.ranks.pop(slot, None)
        self._dropped.append(slot)
        self._schedule()

    def _schedule(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Sends what was queued as ``node_answers`` lines (one, unless it would be too long)."""
        self._flushing = False
        outbox, dropped = self._outbox, self._dropped
        self._outbox, self._dropped = [], []
        while outbox or dropped:
            size, n = 0, 0
            while n < len(outbox) and (n == 0 or size + len(outbox[n][1]) < MAX_ANSWER_LINE):
                size += len(outbox[n][1]) + 16
                n += 1
            batch, outbox = outbox[:n], outbox[n:]
            self.link.send_payload(answers_payload(batch, dropped))
            dropped = []


def answers_payload(batch: list[tuple[Slot, bytes]], dropped: list[Slot]) -> bytes:
    """The JSON text of a :class:`~unbroken.control.messages.NodeAnswers` whose messages are
    already encoded (a full quorum answer's text is shared by many ranks: it is not parsed again)."""
    to = json.dumps([list(s) for s, _ in batch], separators=(",", ":")).encode()
    gone = json.dumps([list(s) for s in dropped], separators=(",", ":")).encode()
    msgs = b",".join(p for _, p in batch)
    return b'{"op":"%s","to":%s,"msgs":[%s],"dropped":%s}' % (protocol.NodeAnswers.OP.encode(), to, msgs, gone)


class NodeLink(protocol.Link):
    """A rank's link through its node's connection: what is sent to it is queued on the node's."""

    __slots__ = ("node", "slot", "closed")

    def __init__(self, node: NodeConn, slot: Slot) -> None:  # noqa: D107 -- no Link.__init__: no stream of its own
        parent = node.link
        self.reader, self.writer, self.session = parent.reader, parent.writer, parent.session
        self.sent = self.received = 0
        self.node, self.slot, self.closed = node, slot, False

    def send(self, msg: protocol.Message) -> None:
        if msg.keys() == _SAME_KEYS:  # the fast path's answer, eight per node per step: no json.dumps
            payload = _SAME % (msg["id"], msg["same_epoch"], msg["step"])
        else:
            payload = json.dumps(msg, separators=(",", ":")).encode()
        self.send_payload(payload)

    def send_payload(self, payload: bytes) -> None:
        if not self.closed and not self.writer.is_closing():
            self.node.queue(self.slot, payload)
            self.sent += 1

    def close(self) -> None:
        """The coordinator ends this rank's connection (an eviction): the node is told, the rest of
        its ranks stay connected."""
        if not self.closed:
            self.closed = True
            if self.node.ranks.get(self.slot) is not None and self.node.ranks[self.slot].link is self:
                self.node.drop(self.slot)


class NodeRelay:
    """The coordinator's handling of node connections, given its per-rank operations.

    Args:
        hello: registers one rank (as a rank's own hello would), on the link given; raises on a refusal.
        quorum: one rank's quorum request.
        closed: one rank's connection ended (it is evicted unless it finished).
        refused: the exceptions ``hello`` refuses a rank with (that rank alone is refused).
        said: one rank's other message (one of :data:`~unbroken.control.messages.NODE_SAID`), as
            its own connection would have said it.
    """

    def __init__(
        self,
        hello: Callable[[protocol.Hello, protocol.Link], RankConn],
        quorum: Callable[[RankConn, protocol.QuorumAsk], None],
        closed: Callable[[RankConn], None],
        refused: tuple[type[Exception], ...],
        said: Callable[[RankConn, protocol.Message], None] | None = None,
    ) -> None:
        self.hello_rank, self.quorum, self.closed = hello, quorum, closed
        self.refused, self.said = refused, said
        self.connected: set[NodeConn] = set()  # the node connections served now (``unbroken status``)
        self.handlers: dict[str, Callable[[NodeConn, protocol.Message], None]] = {
            protocol.NodeHello.OP: lambda node, msg: self.hello(node, protocol.NodeHello.from_msg(msg)),
            protocol.NodeHeartbeat.OP: lambda node, msg: self._beats(node, protocol.NodeHeartbeat.from_msg(msg)),
            protocol.NodeQuorum.OP: lambda node, msg: self._asks(node, protocol.NodeQuorum.from_msg(msg)),
            protocol.NodeSay.OP: lambda node, msg: self._says(node, protocol.NodeSay.from_msg(msg)),
            protocol.NodeLeave.OP: lambda node, msg: self._leave(node, protocol.NodeLeave.from_msg(msg)),
        }

    def open(self, hello: protocol.NodeHello, link: protocol.Link) -> NodeConn:
        """A connection's first ``node_hello``: the node connection, with the ranks it speaks for."""
        node = NodeConn(hello.node, link)
        self.connected.add(node)
        try:
            self.hello(node, hello)
        except Exception:
            self.gone(node)
            raise
        return node

    def status(self) -> dict[str, int]:
        """The ranks each node connection speaks for now, by node."""
        return {node.node: len(node.ranks) for node in sorted(self.connected, key=lambda n: n.node)}

    def hello(self, node: NodeConn, hello: protocol.NodeHello) -> None:
        if hello.node != node.node:
            raise ValueError(f"this connection speaks for node {node.node!r}, not {hello.node!r}")
        if len(node.ranks) + len(hello.ranks) > MAX_NODE_RANKS:
            raise ValueError(f"a node connection speaks for at most {MAX_NODE_RANKS} ranks")
        for h in hello.ranks:
            slot = (h.replica, h.rank)
            link = NodeLink(node, slot)
            try:
                node.ranks[slot] = self.hello_rank(h, link)
            except self.refused as e:  # that rank alone: its node's other ranks are not refused with it
                link.send(protocol.Error(str(e)).to_msg())
                node.drop(slot)

    def handle(self, node: NodeConn, op: str, msg: protocol.Message) -> None:
        handler = self.handlers.get(op)
        if handler is None:
            raise ValueError(f"a node connection does not say {op!r}")
        handler(node, msg)

    def _asks(self, node: NodeConn, asks: protocol.NodeQuorum) -> None:
        for replica, rank, ask in asks.asks:
            conn = node.ranks.get((replica, rank))
            if conn is None:  # not one of its ranks (or one evicted a moment ago): it is told
                node.drop((replica, rank))
                continue
            self.quorum(conn, ask)

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
            if self.said is None:
                raise ValueError("this coordinator takes no node_say")
            try:
                self.said(conn, msg)
            except (ValueError, TypeError, KeyError, OverflowError) as e:
                conn.link.send(protocol.Error(f"malformed message skipped: {e}").to_msg())

    def _leave(self, node: NodeConn, leave: protocol.NodeLeave) -> None:
        for slot in leave.ranks:
            conn = node.ranks.pop(slot, None)
            if conn is not None:
                self.closed(conn)

    def gone(self, node: NodeConn) -> None:
        """The node's connection ended: every rank it spoke for is gone with it."""
        self.connected.discard(node)
        ranks, node.ranks = node.ranks, {}
        for conn in ranks.values():
            self.closed(conn)
