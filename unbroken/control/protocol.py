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

Client -> coordinator ops: ``hello``, ``heartbeat``, ``quorum`` (with ``failed_epoch`` and the
exchange's ``failure`` text after a failed exchange), ``bye``, ``exited``.
Coordinator -> client ops: ``welcome``, ``quorum`` (the answer, same ``id``), ``abort``,
``error``. A quorum answer in the epoch this connection was last answered with, with nobody
behind (the fast path: same members, next step), is short: ``same_epoch`` and ``step`` only,
and the client fills in the rest from that last full answer (:func:`expand_answer`). The
members and their addresses travel once per epoch, not once per step: on the fast path a
client receives a few dozen bytes whatever the job's size.

Each incoming op is parsed into a frozen dataclass below (:class:`Hello`, :class:`QuorumAsk`,
:class:`Heartbeat`, :class:`Exited`, :class:`AgentHello`, :class:`StackReport`) with the bounds
of :func:`count`, :func:`seconds` and :func:`text`; what the coordinator sends is built from
the dataclasses of its ops (:class:`Welcome`, :class:`QuorumAnswer`, :class:`Abort`, ...).
Telemetry batches are parsed by the diagnosis master.

Node agents (``unbroken agent``) keep a connection of their own: agent -> coordinator
``agent_hello`` (node, slots), ``agent_heartbeat``, ``exited``, ``stack``; coordinator -> agent
``assign`` (replica ids to start), ``agent_status`` (their steps), ``dump_stack``,
``job_finished``, ``job_failed`` (the job is ended: stop, exit with its code), ``error``. The
agent's connection closing means every replica it ran is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import socket
from typing import Any

from unbroken.control.failure import MAX_FAILURE_CHARS
from unbroken.wire.auth import JobSecret, Session, client_handshake, client_handshake_async

Message = dict[str, Any]

MAX_LINE = 1 << 20
PURPOSE = "coordinator"  # binds the handshake to this listener: no other's can be replayed here
MAX_SECONDS = 86400.0  # no duration the job reports (a step, a compute time) is longer than a day


def encode(msg: Message, session: Session) -> bytes:
    """One line: the message as JSON, sealed with the connection's next MAC."""
    return session.seal_line(json.dumps(msg, separators=(",", ":")).encode())


def decode(line: bytes, session: Session) -> Message:
    """The message of one sealed line.

    Raises:
        AuthError: the MAC is missing or wrong: the connection must be dropped (its sequence
            is out of step, and the peer is not who it claims).
        ValueError: an authentic line that is no protocol message (a peer's bug): skip it.
    """
    msg = json.loads(session.open_line(line))
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

    def close(self) -> None:
        self.writer.close()


def connect(host: str, port: int, secret: JobSecret, timeout: float) -> tuple[socket.socket, Session]:
    """A blocking, authenticated connection to the coordinator (closed again on any failure)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        if connected_to_itself(sock):
            raise ConnectionRefusedError("no coordinator yet (connected to itself)")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = client_handshake(sock, secret, PURPOSE, timeout_s=timeout)
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


def count(msg: Message, key: str, default: int | None = None) -> int:
    """``msg[key]`` as a non-negative integer (a step, an id, an epoch); ValueError otherwise."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r:.40}")
    return value


def seconds(msg: Message, key: str, default: float | None) -> float | None:
    """``msg[key]`` as a duration of 0 to :data:`MAX_SECONDS`, or None; ValueError otherwise.

    Bounded, not merely finite: a step time of 1e308 would stretch the join window forever.
    """
    value = msg.get(key, default)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_SECONDS
    ):
        raise ValueError(f"{key} must be a number of seconds from 0 to {MAX_SECONDS:g}, got {value!r:.40}")
    return float(value)


def text(msg: Message, key: str, max_len: int = 256) -> str:
    """``msg[key]`` as a string of at most ``max_len`` characters ("" when absent); ValueError otherwise."""
    value = msg.get(key, "")
    if not isinstance(value, str) or len(value) > max_len:
        raise ValueError(f"{key} must be a string of at most {max_len} characters, got {value!r:.40}")
    return value


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


# -- typed messages --------------------------------------------------------------------------
#
# What a peer sends is parsed once, at the coordinator's edge, into one of these: every field
# validated by the functions above (types, bounds, lengths), so the handlers past
# :meth:`Coordinator._dispatch` work with named, typed fields and never with the raw dict. The
# job-relative checks (a replica id below the job's count, a rank below its world size) stay
# with the coordinator, which knows the job. What the coordinator sends is built from these
# too (:meth:`to_msg`), so both sides of a line are spelt in one place.

MAX_STACK = 8000  # characters of a stack kept in an event


@dataclasses.dataclass(frozen=True)
class Hello:
    """A rank says who it is (the first line of a replica's connection)."""

    replica: int
    rank: int
    world_size: int
    transfer_addr: str
    node: str
    step: int

    @classmethod
    def from_msg(cls, msg: Message) -> Hello:
        return cls(
            replica=count(msg, "replica"),
            rank=count(msg, "rank"),
            world_size=count(msg, "world_size"),
            transfer_addr=text(msg, "transfer_addr"),
            node=text(msg, "node"),
            step=count(msg, "step", 0),
        )


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A rank is alive; its step and compute time, when it sends them."""

    step: int | None
    compute_s: float | None

    @classmethod
    def from_msg(cls, msg: Message) -> Heartbeat:
        step = None if msg.get("step") is None else count(msg, "step")
        return cls(step=step, compute_s=seconds(msg, "compute_s", None))


@dataclasses.dataclass(frozen=True)
class QuorumAsk:
    """A rank's quorum request for ``step`` (``failed_epoch``: its exchange in that epoch failed,
    ``failure``: with this error, which the coordinator classifies itself)."""

    id: int
    step: int
    step_time: float | None
    failed_epoch: int | None
    failure: str | None = None

    @classmethod
    def from_msg(cls, msg: Message) -> QuorumAsk:
        failed = None if msg.get("failed_epoch") is None else count(msg, "failed_epoch")
        failure = msg.get("failure")
        if failure is not None and (not isinstance(failure, str) or len(failure) > MAX_FAILURE_CHARS):
            raise ValueError(f"failure must be a string of at most {MAX_FAILURE_CHARS} characters")
        return cls(
            id=count(msg, "id"),
            step=count(msg, "step"),
            step_time=seconds(msg, "step_time", None),
            failed_epoch=failed,
            failure=failure if failed is not None else None,
        )


@dataclasses.dataclass(frozen=True)
class Exited:
    """A process of ``replica`` exited (reported by its supervisor, agent, or a sibling rank)."""

    replica: int
    exitcode: int | None

    @classmethod
    def from_msg(cls, msg: Message) -> Exited:
        code = msg.get("exitcode")
        if code is not None and (type(code) is not int or not -256 <= code <= 255):
            raise ValueError(f"exitcode must be an integer from -256 to 255, got {code!r:.40}")
        return cls(replica=count(msg, "replica"), exitcode=code)


@dataclasses.dataclass(frozen=True)
class AgentHello:
    """A node agent says which node it is, how many replicas it can run and which run already."""

    node: str
    slots: int
    running: tuple[int, ...]
    nodes_per_replica: int = 1  # nodes each replica group spans (every agent of a job says the same)
    addr: str = ""  # where the group's other nodes reach this one (checked when groups span nodes)

    @classmethod
    def from_msg(cls, msg: Message, max_slots: int, max_nodes_per_replica: int = 1024) -> AgentHello:
        node, slots, running = text(msg, "node"), count(msg, "slots", 1), msg.get("running", [])
        if not node or not 1 <= slots <= max_slots or not isinstance(running, list) or len(running) > max_slots:
            raise ValueError(f"an agent_hello needs a node name, 1 to {max_slots} slots and a list of running replicas")
        nodes_per_replica = count(msg, "nodes_per_replica", 1)
        if not 1 <= nodes_per_replica <= max_nodes_per_replica:
            raise ValueError(f"nodes_per_replica must be 1 to {max_nodes_per_replica}, got {nodes_per_replica}")
        return cls(
            node=node,
            slots=slots,
            running=tuple(count({"r": r}, "r") for r in running),
            nodes_per_replica=nodes_per_replica,
            addr=text(msg, "addr", 64),
        )


@dataclasses.dataclass(frozen=True)
class StackReport:
    """A node agent's answer to ``dump_stack``: the hung rank's stack, or why there is none."""

    replica: int
    rank: int
    process_state: str
    stack: str | None
    stack_note: str

    @classmethod
    def from_msg(cls, msg: Message) -> StackReport:
        stack = msg.get("stack")
        return cls(
            replica=count(msg, "replica"),
            rank=count(msg, "rank"),
            process_state=text(msg, "process_state", 4),
            stack=stack[-MAX_STACK:] if isinstance(stack, str) else None,
            stack_note=text(msg, "stack_note", 500),
        )


@dataclasses.dataclass(frozen=True)
class Welcome:
    store: str
    epoch: int
    heartbeat_s: float  # the period the rank must heartbeat at (it grows with the job's size)
    timeout_s: float  # silence after which the coordinator evicts a replica

    def to_msg(self) -> Message:
        return {"op": "welcome", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class QuorumAnswer:
    """A full quorum answer's fields; the coordinator sends it pre-encoded (:func:`answer_tail`),
    with ``transfer_addrs`` holding only a behind replica's donor (nobody else fetches)."""

    id: int
    decision: dict[str, Any]
    transfer_addrs: dict[str, str]
    store: str

    def to_msg(self) -> Message:
        return {"op": "quorum", **dataclasses.asdict(self)}


def answer_tail(decision: dict[str, Any], transfer_addrs: dict[str, str], store: str) -> bytes:
    """The part of a full quorum answer that every rank of the same rank index shares.

    Encoded once per decision and rank index, not once per connection: at thousands of
    members the answer is tens of kilobytes, and its JSON text the costliest thing to make.
    """
    body = json.dumps({"decision": decision, "transfer_addrs": transfer_addrs, "store": store}, separators=(",", ":"))
    return body[1:].encode()  # without the opening brace: answer_payload puts op and id first


def answer_payload(req_id: int, tail: bytes) -> bytes:
    """The JSON text of a full quorum answer to request ``req_id`` (see :func:`answer_tail`)."""
    return b'{"op":"quorum","id":%d,%s' % (req_id, tail)


@dataclasses.dataclass(frozen=True)
class QuorumSame:
    """The fast path's answer: the epoch this connection holds, now at ``step``, nobody behind."""

    id: int
    same_epoch: int
    step: int

    def to_msg(self) -> Message:
        return {"op": "quorum", "id": self.id, "same_epoch": self.same_epoch, "step": self.step}


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


@dataclasses.dataclass(frozen=True)
class Abort:
    epoch: int

    def to_msg(self) -> Message:
        return {"op": "abort", "epoch": self.epoch}


@dataclasses.dataclass(frozen=True)
class Donate:
    to: int

    def to_msg(self) -> Message:
        return {"op": "donate", "to": self.to}


@dataclasses.dataclass(frozen=True)
class Assign:
    replicas: list[int]
    num_replicas: int

    def to_msg(self) -> Message:
        return {"op": "assign", "replicas": list(self.replicas), "num_replicas": self.num_replicas}


@dataclasses.dataclass(frozen=True)
class AgentStatus:
    steps: dict[str, int]

    def to_msg(self) -> Message:
        return {"op": "agent_status", "steps": dict(self.steps)}


@dataclasses.dataclass(frozen=True)
class DumpStack:
    replica: int
    rank: int

    def to_msg(self) -> Message:
        return {"op": "dump_stack", "replica": self.replica, "rank": self.rank}


@dataclasses.dataclass(frozen=True)
class Error:
    message: str

    def to_msg(self) -> Message:
        return {"op": "error", "message": self.message[:500]}


@dataclasses.dataclass(frozen=True)
class JobFailedNotice:
    """Coordinator -> agent: the job is ended (:mod:`unbroken.control.job_health`); stop every
    worker and exit with ``exit_code``."""

    reason: str
    exit_code: int

    def to_msg(self) -> Message:
        return {"op": "job_failed", "reason": self.reason[:1000], "exit_code": self.exit_code}

    @classmethod
    def from_msg(cls, msg: Message) -> JobFailedNotice:
        code = msg.get("exit_code")
        if type(code) is not int or not 1 <= code <= 255:
            raise ValueError(f"exit_code must be an integer from 1 to 255, got {code!r:.40}")
        return cls(reason=text(msg, "reason", 1000), exit_code=code)
