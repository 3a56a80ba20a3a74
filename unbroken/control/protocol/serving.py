"""The coordinator's connections: admitted, authenticated, read line by line, and bounded.

Each connection is served by :meth:`ConnectionServer.serve` until it ends: nothing is read from
it before it proves it holds the job's secret (:mod:`unbroken.wire.auth`), strangers count
only against their own budget (:mod:`unbroken.wire.admission`), one that says nothing about who
it is within ``hello_timeout_s`` is closed, and a flood of malformed messages ends it. Each
message goes to the coordinator's ``dispatch``; the rank or agent a connection spoke as is
handed to ``closed`` when it ends, however it ends.

A node agent's relay (:mod:`unbroken.launch.node.relay`) serves its ranks with the same class: they
are admitted and authenticated exactly as by the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from unbroken.control import protocol
from unbroken.wire.admission import Admission, RefusalLog
from unbroken.wire.auth import TICKET_BYTES, AuthError, JobSecret, server_handshake_async

log = logging.getLogger("unbroken.control.coordinator")  # the coordinator's log, as before the split

# A connection that sends this many malformed messages is not a replica gone astray: it is closed.
MAX_BAD_MESSAGES = 100
# How long a line said to a standby that is not serving yet waits for it to take over.
HOLD_S = 5.0
FENCE_POLL_S = 0.01  # how often a line that waits for the lease looks again

C = TypeVar("C")  # who a connection speaks as: a rank (or a node's ranks) ...
A = TypeVar("A")  # ... or an agent

# Acts on one message (msg, link, the rank and agent it spoke as so far) and returns the op and
# who the connection speaks as now; the op ``stop`` ends the connection.
Dispatch = Callable[[protocol.Message, protocol.Link, C | None, A | None], tuple[str, C | None, A | None]]


class PreSay(Protocol):
    """What a held connection said before the takeover, kept (:meth:`ConnectionServer.hold`)."""

    def said(self, link: protocol.Link, msg: protocol.Message) -> bool: ...

    def forget(self, link: protocol.Link) -> None: ...


class Refused(Exception):
    """A request that ends its connection (a takeover of a live slot, a second identity)."""


class ConnectionServer(Generic[C, A]):
    """Serves the coordinator's connections (``asyncio.start_server``'s callback is :meth:`serve`).

    Args:
        secret: the job's secret.
        max_connections: connections served at once; more are closed at once.
        hello_timeout_s: an authenticated connection that said nothing within this is closed.
        dispatch: acts on one message (raises ValueError on a malformed one, Refused to end it).
        closed: called with the rank and agent a connection spoke as, once it ended.
        what: the listener, as its refusals are logged.
    """

    def __init__(
        self,
        secret: JobSecret,
        max_connections: int,
        hello_timeout_s: float,
        dispatch: Dispatch[C, A],
        closed: Callable[[C | None, A | None], None],
        what: str = "the coordinator",
    ) -> None:
        self.secret = secret
        self.max_connections, self.hello_timeout_s = max_connections, hello_timeout_s
        self.dispatch, self.closed = dispatch, closed
        self.open: set[asyncio.StreamWriter] = set()  # every connection served now
        self.auth_failures = 0  # connections dropped for failing the handshake or a MAC
        self.vanished = 0  # connections that closed before saying a byte (not refused: gone)
        self._admission: Admission[asyncio.StreamWriter] = Admission()
        self._refusals = RefusalLog(log, f"dropped connections to {what}")
        self.lines_in = self.lines_out = 0  # over closed connections (what `unbroken bench auth` counts)
        # While holding (hold()): each held line's wait for open_to(), with its HOLD_S timer.
        self._holding: dict[asyncio.Future[bool], asyncio.TimerHandle] | None = None
        self._presaid: PreSay | None = None
        # Held connections whose first line waits for open_to(), and that line (which the standby
        # may take as said beforehand when it takes over: PreSay.adopt): the line is then not served.
        self.speaking: dict[protocol.Link, protocol.Message | ValueError] = {}
        self._adopted: dict[protocol.Link, C] = {}  # who held connections speak for once served (open_to)
        # Whether the server may answer now (the coordinator's lease): while it may not, a line
        # waits unread-on (its connection kept) until it may, or until the connection is closed.
        self.fence: Callable[[], bool] | None = None
        self.fenced_waits = 0  # lines that waited for the lease (a store stall), none dropped

    def hold(self, presaid: PreSay | None = None) -> None:
        """Accepts and authenticates connections now, and serves them once :meth:`open_to` is called.

        A standby listens this way while it waits for its turn: each node agent keeps one idle,
        authenticated connection to it (:mod:`unbroken.launch.node.relay`), so a takeover costs the
        standby no accept and no handshake per node, only the hellos (at 12,500 nodes the
        handshakes alone were seconds of its one core). A line said before then waits up to
        :data:`HOLD_S` for the takeover; past that the standby says it is not serving, and
        closes (the peer goes on to the active coordinator).

        ``presaid`` is offered every line a held connection says first: what it keeps (True) is
        said beforehand, not held (a node's hello: :class:`~unbroken.control.nodes.node_relay.PreSaid`),
        and the connection is read on; it is told of a held connection that ended.
        """
        self._holding = {}
        self._presaid = presaid

    def open_to(
        self,
        dispatch: Dispatch[C, A],
        closed: Callable[[C | None, A | None], None],
        adopted: Mapping[protocol.Link, C] | None = None,
    ) -> None:
        """Serves the held connections, and every later one, with ``dispatch`` and ``closed``;
        ``adopted``: who held connections speak for already (what they said beforehand)."""
        self.dispatch, self.closed = dispatch, closed
        self._adopted = dict(adopted or {})
        self._presaid = None
        holding, self._holding = self._holding, None
        for waiting, timer in (holding or {}).items():
            timer.cancel()
            if not waiting.done():
                waiting.set_result(True)

    def close_all(self, abort: bool = False) -> None:
        """Closes every connection; ``abort``: drops what is queued to them unsent (a coordinator
        that lost its lease: nothing it said before stepping down may leave after)."""
        for writer in list(self.open):
            if abort:
                writer.transport.abort()
            else:
                writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Until its ticket shows a key holder, a connection counts only against the budget of
        # strangers (newest first, wire.admission), never against max_connections. One yield
        # first: the loop then reads what arrived with the connection (a key holder's ticket)
        # before this burst of accepts can shed it.
        await asyncio.sleep(0)
        peer = writer.get_extra_info("peername")
        for shed in self._admission.admit(writer, str(peer[0]) if peer else "", time.monotonic()):
            shed.transport.abort()
        self.open.add(writer)
        conn: C | None = None
        agent: A | None = None
        try:
            try:
                try:
                    ticket = await asyncio.wait_for(reader.readexactly(TICKET_BYTES), self._admission.policy.deadline_s)
                finally:
                    self._admission.release(writer)
                if len(self.open) - len(self._admission) > self.max_connections:
                    self.dropped(f"over {self.max_connections} connections", auth=False)
                    return
                session = await server_handshake_async(reader, writer, self.secret, protocol.PURPOSE, ticket=ticket)
            except (AuthError, OSError, asyncio.IncompleteReadError, RuntimeError) as e:  # TimeoutError is an OSError
                # RuntimeError: uvloop's write to a transport closed mid-handshake (a stranger shed,
                # a peer gone: thousands reconnect at once to a standby taking over).
                if isinstance(e, asyncio.IncompleteReadError) and not e.partial:
                    # Closed before a byte: a process that died while it connected (the job's own
                    # replica killed), or a port probe. Nothing was refused: no warning to read.
                    self.vanished += 1
                    log.debug("a connection closed before it said anything")
                    return
                self.dropped(str(e) or "no ticket in time")
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
            self.open.discard(writer)
            writer.close()
            self.closed(conn, agent)

    async def _held(self, link: protocol.Link) -> protocol.Message | ValueError | None:
        """Until :meth:`open_to`: the connection's first message, once this server serves (None:
        nothing held, or it ended, failed its MAC, or said something before a takeover that did not
        come; a ValueError: it is malformed).

        Its MAC is checked and its JSON parsed while the standby waits to take over, not in the
        burst of the takeover: a node agent says its hello as soon as the active coordinator is
        gone, before the standby may answer it (a lease before, for a hung one; for a dead one,
        the few tens of milliseconds until the standby sees its lock free)."""
        if self._holding is None:
            return None
        try:
            while True:
                line = await link.readline()  # no timeout: a warm connection says nothing until it is needed
                if line is None:
                    return None
                try:
                    msg: protocol.Message | ValueError = link.decode(line)
                except AuthError as e:
                    self.dropped(f"{e} (from a client)")
                    return None
                except ValueError as e:
                    msg = e
                if self._holding is None:  # served already: a line as any other
                    return msg
                if not isinstance(msg, ValueError) and self._presaid is not None and self._presaid.said(link, msg):
                    continue
                self.speaking[link] = msg
                try:
                    served = await self._until_served(self._holding)
                finally:
                    taken = self.speaking.pop(link, None) is None
                if not served:
                    link.send(protocol.Error("a standby coordinator, not serving: the active one is alive").to_msg())
                    return None
                if not taken:
                    return msg
                # taken as said beforehand when the standby took over: the next line is the first served
        finally:
            if self._holding is not None and self._presaid is not None:
                self._presaid.forget(link)  # ended (or refused) before the takeover: nothing it said stands

    @staticmethod
    def _until_served(holding: dict[asyncio.Future[bool], asyncio.TimerHandle]) -> asyncio.Future[bool]:
        """True once :meth:`open_to` is called, False after :data:`HOLD_S`: a future and a timer
        per held line, not a task (``wait_for``'s) that 12,500 lines woke at once in a takeover."""
        loop = asyncio.get_running_loop()
        waiting: asyncio.Future[bool] = loop.create_future()

        def lapsed() -> None:
            holding.pop(waiting, None)
            if not waiting.done():
                waiting.set_result(False)

        holding[waiting] = loop.call_later(HOLD_S, lapsed)
        return waiting

    async def _converse(self, link: protocol.Link, who: list[Any]) -> None:
        """Serves one authenticated connection until it ends; ``who`` holds the rank connection
        and the agent it spoke as (kept up to date, so a connection error still cleans up)."""
        bad = 0
        held = self._holding is not None
        try:
            first = await self._held(link)
        finally:
            if self._adopted:  # it spoke for its node before the takeover: it does from the start
                who[0] = self._adopted.pop(link, who[0])
        if first is None and held:
            return
        while True:
            conn, agent = who
            error: Exception
            msg: protocol.Message | ValueError
            if first is not None:
                msg, first = first, None
            else:
                try:
                    # wait_for only until it said who it is: a layer of coroutine per line otherwise
                    wait = link.readline()
                    anonymous = conn is None and agent is None
                    line = await (asyncio.wait_for(wait, self.hello_timeout_s) if anonymous else wait)
                except (asyncio.TimeoutError, TimeoutError):
                    log.info("closed a connection that said no hello within %.0fs", self.hello_timeout_s)
                    return
                if line is None:
                    return
                try:
                    msg = link.decode(line)
                except AuthError as e:
                    rank = getattr(conn, "rank", None)  # a rank's connection (quorum.service.RankConn): named
                    who_ = f"replica {getattr(conn, 'replica', '?')} rank {rank}" if rank is not None else "a client"
                    self.dropped(f"{e} (from {who_})")
                    return
                except ValueError as e:
                    msg = e
            if isinstance(msg, ValueError):
                error = msg
            else:
                if self.fence is not None and not self.fence() and not await self._until_fenced_in(link):
                    return
                try:
                    kind, who[0], who[1] = self.dispatch(msg, link, conn, agent)
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

    async def _until_fenced_in(self, link: protocol.Link) -> bool:
        """Waits while the lease is not valid (a metadata stall on its store lapses it for a
        moment): True once it is again, False once the connection is closed (the coordinator
        stepped down, or gave up on its store, and closed every connection). Dropping the line
        instead would make every rank that spoke in a stall reconnect, and evict it."""
        assert self.fence is not None
        self.fenced_waits += 1
        while not self.fence():
            if link.writer.is_closing():
                return False
            await asyncio.sleep(FENCE_POLL_S)
        return not link.writer.is_closing()

    def dropped(self, reason: str, auth: bool = True) -> None:
        """Counts a refused connection; logs once per interval (a flood is no log flood)."""
        if auth:
            self.auth_failures += 1
        self._refusals.note(reason, time.monotonic())
