"""The coordinator's wire format: one MACed JSON object per line over a persistent TCP connection.

A persistent connection is the point: when a replica process dies, the kernel closes its socket
and the coordinator learns it within milliseconds, with no heartbeat timeout; and the
coordinator can push an abort to a replica blocked in an exchange.

Every connection starts with the mutual handshake of :mod:`unbroken.wire.auth` (purpose
:data:`PURPOSE`): nobody without the job's secret gets a line read, and each line then carries a
MAC over a per-direction sequence number (:func:`encode` / :func:`decode` are the only way to
write or read one), so a line cannot be forged, replayed, reordered or reflected. Threat model:
anyone who can reach the port; on-path injection into an established TCP connection is out of
scope, as for Gloo and NCCL.

The operations, and the typed message of each, are listed once, in
:data:`unbroken.control.protocol.messages.MESSAGES` (re-exported here, with every message class, so that
``protocol.Hello`` and the rest read as before). A quorum answer in the epoch this connection
was last answered with, with nobody behind (the fast path: same members, next step), is short:
``same_epoch`` and ``step`` only, and the client fills in the rest from that last full answer
(:func:`expand_answer`). The members and their addresses travel once per epoch, not once per
step: on the fast path a client receives a few dozen bytes whatever the job's size. Node agents
(``unbroken agent``) keep a connection of their own; its closing means every replica the agent
ran is gone.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import Any

from unbroken.control.protocol.messages import (
    MAX_SECONDS,
    MAX_STACK,
    MESSAGES,
    NODE_SAID,
    Abort,
    AgentHeartbeat,
    AgentHello,
    AgentStatus,
    Alive,
    Assign,
    Bye,
    Direction,
    Donate,
    DumpStack,
    EpochPush,
    Error,
    Exited,
    GroupAssign,
    GroupPort,
    GroupRelease,
    GroupStop,
    Heartbeat,
    Hello,
    JobFailedNotice,
    JobFinished,
    Message,
    NodeAnswers,
    NodeHeartbeat,
    NodeHello,
    NodeLeave,
    NodeQuorum,
    NodeSay,
    Prepare,
    QuorumAnswer,
    QuorumAsk,
    QuorumSame,
    StackReport,
    StatusRequest,
    Telemetry,
    Welcome,
    count,
    ops,
    seconds,
    text,
)
from unbroken.wire import jsontext
from unbroken.wire.auth import JobSecret, Session, client_handshake, client_handshake_async

__all__ = [
    "ALIVE",
    "MAX_LINE",
    "MAX_SECONDS",
    "MAX_STACK",
    "MESSAGES",
    "NODE_SAID",
    "PURPOSE",
    "Abort",
    "AgentHeartbeat",
    "AgentHello",
    "AgentStatus",
    "Assign",
    "Bye",
    "Alive",
    "Direction",
    "Donate",
    "Prepare",
    "EpochPush",
    "DumpStack",
    "Error",
    "Exited",
    "GroupAssign",
    "GroupPort",
    "GroupRelease",
    "GroupStop",
    "Heartbeat",
    "Hello",
    "JobFailedNotice",
    "JobFinished",
    "Link",
    "Message",
    "NodeAnswers",
    "NodeHeartbeat",
    "NodeHello",
    "NodeLeave",
    "NodeQuorum",
    "NodeSay",
    "QuorumAnswer",
    "QuorumAsk",
    "QuorumSame",
    "StackReport",
    "StatusRequest",
    "Telemetry",
    "Welcome",
    "answer_payload",
    "answer_tail",
    "push_payload",
    "same_payload",
    "welcome_payload",
    "connect",
    "connect_async",
    "count",
    "decode",
    "encode",
    "expand_answer",
    "ops",
    "request",
    "seconds",
    "text",
]

MAX_LINE = 1 << 20
PURPOSE = "coordinator"  # binds the handshake to this listener: no other's can be replayed here


def encode(msg: Message, session: Session) -> bytes:
    """One line: the message as JSON, sealed with the connection's next MAC."""
    return session.seal_line(jsontext.dumps(msg))


def decode(line: bytes, session: Session) -> Message:
    """The message of one sealed line.

    Raises:
        AuthError: the MAC is missing or wrong: the connection must be dropped (its sequence
            is out of step, and the peer is not who it claims).
        ValueError: an authentic line that is no protocol message (a peer's bug): skip it.
    """
    msg = jsontext.loads(session.open_line(line))
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError(f"not a protocol message: {line[:80]!r}")
    return msg


class Link:
    """One authenticated asyncio connection: every line in or out of it passes here, sealed.

    The coordinator keeps one per connection, the agent one to the coordinator; the MAC's
    sequence numbers make it the one writer of its stream (asyncio: one thread).
    """

    __slots__ = ("reader", "writer", "session", "sent", "received")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Session) -> None:
        self.reader, self.writer, self.session = reader, writer, session
        self.sent = self.received = 0  # lines, for `unbroken bench auth`

    async def readline(self) -> bytes | None:
        """The next raw line, None at the end; ConnectionError on a line over :data:`MAX_LINE`."""
        try:
            line = await self.reader.readline()
        except ValueError as e:  # asyncio's limit: the line is unbounded, the stream unusable
            raise ConnectionError(f"a line of more than {MAX_LINE} bytes") from e
        return line or None

    def decode(self, line: bytes) -> Message:
        """:func:`decode` with this connection's session (AuthError: drop the connection)."""
        self.received += 1
        return decode(line, self.session)

    def send(self, msg: Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg, self.session))
            self.sent += 1

    def send_payload(self, payload: bytes) -> None:
        """Sends a message already encoded as JSON (one text shared by many answers), sealed."""
        if not self.writer.is_closing():
            self.writer.write(self.session.seal_line(payload))
            self.sent += 1

    def flush(self) -> None:
        """Sends what this link holds back: nothing, its lines go out as they are sent (a node
        connection's rank links hold theirs for one ``node_answers`` line)."""

    def close(self) -> None:
        self.writer.close()


def connect(host: str, port: int, secret: JobSecret, timeout: float) -> tuple[socket.socket, Session]:
    """A blocking, authenticated connection to the coordinator (closed again on any failure)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        if connected_to_itself(sock):
            raise ConnectionRefusedError("no coordinator yet (connected to itself)")
        session = client_handshake(sock, secret, PURPOSE, timeout_s=timeout)  # sets TCP_NODELAY
    except BaseException:
        sock.close()
        raise
    return sock, session


async def connect_async(
    host: str, port: int, secret: JobSecret, timeout: float = 10.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Session]:
    """An asyncio, authenticated connection to the coordinator (closed again on any failure)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_LINE), timeout)
    try:
        sock = writer.get_extra_info("socket")
        if sock is None:  # uvloop: the transport was closed already (the peer reset it at once)
            raise ConnectionRefusedError("the connection closed as it opened")
        if connected_to_itself(sock):
            raise ConnectionRefusedError("no coordinator yet (connected to itself)")
        session = await client_handshake_async(reader, writer, secret, PURPOSE, timeout_s=timeout)
    except BaseException:
        writer.close()
        raise
    return reader, writer, session


def request(host: str, port: int, secret: JobSecret, msg: Message, timeout: float = 2.0) -> Message:
    """One request, one answer on a fresh connection (``unbroken status``)."""
    sock, session = connect(host, port, secret, timeout)
    with sock:
        sock.sendall(encode(msg, session))
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"the coordinator at {host}:{port} closed the connection")
            buf += chunk
            if len(buf) > MAX_LINE:
                raise ConnectionError(f"an answer longer than {MAX_LINE} bytes from {host}:{port}")
    return decode(buf.split(b"\n", 1)[0], session)


def connected_to_itself(sock: socket.socket) -> bool:
    """Whether a loopback connect met no listener but its own port (TCP simultaneous open).

    Reconnecting in a loop to a coordinator that is down, with its port in the ephemeral range,
    can pick that very port as the source: the socket then talks to itself, and an endless
    wait on its own hello follows. Such a socket must be closed and the connect retried.
    """
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False


# -- quorum answers, encoded once and shared --------------------------------------------------


def answer_tail(decision: dict[str, Any], transfer_addrs: dict[str, str], store: str) -> bytes:
    """The part of a full quorum answer that every rank of the same rank index shares.

    Encoded once per decision and rank index, not once per connection: at thousands of
    members the answer is tens of kilobytes, and its JSON text the costliest thing to make.
    """
    body = jsontext.dumps({"decision": decision, "transfer_addrs": transfer_addrs, "store": store})
    return body[1:]  # without the opening brace: answer_payload puts op and id first


def decision_head(decision: dict[str, Any]) -> bytes:
    """A decision's JSON text without its donors and closing brace: what the answer of every
    member named in a donor pair shares (:func:`paired_tail`). Made once per decision: with
    thousands of members behind (a standby's first epoch), encoding the decision again for each
    of them was most of the time to answer them."""
    return jsontext.dumps({k: v for k, v in decision.items() if k != "donors"})[:-1]


def paired_tail(head: bytes, pairs: list[list[int]], transfer_addrs: dict[str, str], store: str) -> bytes:
    """``answer_tail({**decision, "donors": pairs}, transfer_addrs, store)`` from the decision's
    :func:`decision_head`: only the pairs, addresses and store are encoded here."""
    return b'"decision":%s,"donors":%s},"transfer_addrs":%s,"store":%s}' % (
        head,
        jsontext.dumps(pairs),
        jsontext.dumps(transfer_addrs),
        jsontext.dumps(store),
    )


def answer_payload(req_id: int, tail: bytes) -> bytes:
    """The JSON text of a full quorum answer to request ``req_id`` (see :func:`answer_tail`)."""
    return b'{"op":"quorum","id":%d,%s' % (req_id, tail)


#: An :class:`Alive`'s JSON text: sent four times a second to every rank whose request waits
#: (100,000 of them while a standby's first epoch forms), so made once.
ALIVE = jsontext.dumps(Alive().to_msg())


@functools.lru_cache(maxsize=16)
def welcome_payload(welcome: Welcome) -> bytes:
    """A welcome's JSON text, made once: every rank that says hello while the epoch and the
    heartbeat plan stand gets the same one (a standby taking over from 12,500 nodes of 8 ranks
    welcomes 100,000 ranks at once)."""
    return jsontext.dumps(welcome.to_msg())


def same_payload(req_id: int, epoch: int, step: int, through: int | None = None) -> bytes:
    """The JSON text of a :class:`QuorumSame` (as ``json.dumps`` of its ``to_msg`` writes it):
    the fast path's answer, made without a dict or an encoder (eight per 8-rank node per step)."""
    if through is not None and through > step:
        return b'{"op":"quorum","id":%d,"same_epoch":%d,"step":%d,"through":%d}' % (req_id, epoch, step, through)
    return b'{"op":"quorum","id":%d,"same_epoch":%d,"step":%d}' % (req_id, epoch, step)


def push_payload(abort: int, tail: bytes) -> bytes:
    """The JSON text of an :class:`EpochPush` aborting epoch ``abort`` (see :func:`answer_tail`)."""
    return b'{"op":"epoch","abort":%d,%s' % (abort, tail)


def expand_answer(msg: Message, last: Message | None) -> Message:
    """A quorum answer in full: a short one (:class:`QuorumSame`) completed from ``last``, the
    last full answer on the same connection; a full one as it is.

    Raises:
        ValueError: a short answer for an epoch that ``last`` is not (the connection is out of
            step with the coordinator: drop it, reconnect, and ask again for a full answer).
    """
    if "decision" in msg:
        return msg
    epoch, step = count(msg, "same_epoch"), count(msg, "step")
    if last is None or last["decision"].get("epoch") != epoch:
        raise ValueError(f"a short quorum answer for epoch {epoch}, which this connection was never told")
    decision = {**last["decision"], "step": step, "behind": [], "donors": []}
    return {**last, "id": msg.get("id"), "decision": decision}
