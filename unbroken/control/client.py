"""The replica side of the coordinator connection.

One background thread keeps the connection: it reconnects (with bounded backoff) when the
coordinator restarts, re-sends a quorum request that was in flight, sends heartbeats, and hands
pushed aborts to the exchange at once. The training thread only calls :meth:`request_quorum`
and waits on the future it returns.

Nothing the coordinator sends may end that thread: a malformed line is logged and skipped (a
request it should have answered stays pending and is re-sent on the next connection); a line
longer than :data:`~unbroken.control.protocol.MAX_LINE`, or :data:`MAX_BAD_LINES` malformed ones on
one connection, end the connection, and the thread reconnects.

Every connection is authenticated both ways (the job's secret, :mod:`unbroken.wire.auth`) and
every line MACed: a listener that does not hold the secret is no coordinator, and a line that
fails its MAC ends the connection (the thread reconnects).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from unbroken.config import parse_host_ports
from unbroken.control import protocol
from unbroken.control.quorum.heartbeat import COORDINATOR_SILENT_S, heartbeat_due, silent_after
from unbroken.control.quorum.rules import QuorumDecision, members_of_runs, push_answers
from unbroken.control.quorum.silence import SilenceWatch
from unbroken.diagnosis.telemetry import TelemetryBatch
from unbroken.wire.auth import AuthError, JobSecret, Session

log = logging.getLogger(__name__)

MAX_BAD_LINES = 20
DRAIN_S = 0.25  # the longest a commit waits for the connection thread to read what has arrived
HUNG_SKIP_S = 2.0  # the address left for silence is not tried again this long (two leases)

# The heartbeat period a coordinator may ask for: never a flood, never so slow that a timeout
# configured on the coordinator's side could not be met.
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.05, 5.0


class CoordinatorUnreachable(ConnectionError):
    """The coordinator could not be reached within the configured time."""


class OutOfStep(ConnectionError):
    """A short quorum answer this connection cannot complete: it is dropped, and re-asks in full."""


class StaleTerm(OutOfStep):
    """A welcome from a coordinator whose lease term is older than one this client was answered
    in already (a replaced coordinator that still listens): its connection is dropped unheard."""


class QuorumClient(Protocol):
    """What a replica's training loop (:class:`~unbroken.train.manager.Manager`) uses of its
    coordinator connection: :class:`CoordinatorClient` is the one implementation, and every
    stand-in for it in tests is checked against it (``tests/unit/control/test_client_interface.py``)."""

    store_address: str | None
    compute_s: float | None
    silence: SilenceWatch

    def wait_connected(self, timeout: float) -> None: ...

    def request_quorum(
        self,
        step: int,
        failed_epoch: int | None = None,
        step_time: float | None = None,
        failure: str | None = None,
    ) -> Future[dict[str, Any]]: ...

    def drain(self, timeout_s: float = DRAIN_S) -> None: ...

    def next_step_after(self, epoch: int) -> int | None: ...

    def close(self, finished: bool = True) -> None: ...


class CoordinatorClient:
    """A persistent, self-healing connection to the coordinator.

    Args:
        address: ``HOST:PORT`` of the coordinator, or a comma-separated list of them: the
            active coordinator and its standbys (``unbroken coordinator --standby``), tried in
            turn until one answers; after a loss, the one that answered last is tried first.
        secret: the job's secret (:meth:`JobSecret.required` reads the one a worker was started with).
        hello: identity sent on every (re)connection: replica, rank, world_size, transfer_addr,
            node (the fields of :class:`~unbroken.control.protocol.Hello`, checked here).
        on_abort: called from the connection thread with the epoch to abort.
        on_donate: called from the connection thread when this replica will likely serve a
            newcomer (its id) at its next step.
        on_prepare: called from the connection thread with a forecast epoch, its members and
            the store its groups meet on (:class:`~unbroken.control.protocol.Prepare`).
        heartbeat_s: heartbeat period.
        reconnect_timeout_s: give up (fail pending requests) after this long without a
            connection; covers a coordinator restart.
    """

    def __init__(
        self,
        address: str,
        secret: JobSecret,
        hello: dict[str, Any],
        on_abort: Callable[[int], None] | None = None,
        on_donate: Callable[[int], None] | None = None,
        on_prepare: Callable[[int, list[int], str], object] | None = None,
        heartbeat_s: float = 0.1,
        reconnect_timeout_s: float = 120.0,
        telemetry: Callable[[], TelemetryBatch] | None = None,
    ) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError("CoordinatorClient needs the job's JobSecret (there is no unauthenticated mode)")
        self.addresses = parse_host_ports(address, "coordinator address")
        self.host, self.port = self.addresses[0]  # the one connected to (or tried) last
        self.secret = secret
        try:
            self.hello = protocol.Hello.from_msg({**hello, "step": 0})
        except ValueError as e:
            raise ValueError(f"CoordinatorClient's hello: {e}") from None
        self.on_abort = on_abort
        self.on_donate = on_donate
        self.on_prepare = on_prepare
        self.heartbeat_s = heartbeat_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.telemetry = telemetry  # flight-recorder batches ride along with the heartbeat
        self.store_address: str | None = None
        self.step = 0
        self.epoch: int | None = None  # the last epoch answered or pushed: its hello says it (control.resume)
        self.compute_s: float | None = None  # reported in heartbeats, for stragglers and status
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[dict[str, Any], Future[dict[str, Any]]]] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._session: Session | None = None  # the MAC state of self._sock, replaced with it
        self._last_answer: dict[str, Any] | None = None  # this connection's last full quorum answer
        self._pushed: dict[str, Any] | None = None  # an epoch pushed unasked, for the next request
        self._last_sent = float("-inf")  # when a line last went out: any line is a heartbeat
        # Since when a request waits with nothing heard from the coordinator (which says
        # ``alive`` to waiting ranks while it holds its lease): past COORDINATOR_SILENT_S, with
        # a standby's address to try, the coordinator is taken as hung and the next one tried.
        self._quiet_since = 0.0
        self._hop = False
        self.term: int | None = None  # the newest lease term a coordinator welcomed this client in
        self._conn_term: int | None = None  # the term of the connection served now (its welcome's)
        self.coordinator_silent_s = COORDINATOR_SILENT_S
        self.silence = SilenceWatch()  # gaps long enough for the coordinator to have evicted us
        self._reading = threading.Lock()  # held from a read until its lines are handled (drain)
        self._pushed_after: tuple[int, int] | None = None  # (epoch aborted, step of the epoch pushed with it)
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-coordinator", daemon=True)
        self._thread.start()

    def wait_connected(self, timeout: float) -> None:
        if not self._connected.wait(timeout):
            raise CoordinatorUnreachable(
                f"no coordinator answered at {self.host}:{self.port} within {timeout:.0f}s: "
                "is `unbroken coordinator` (or `unbroken run`) running there?"
            )

    def request_quorum(
        self,
        step: int,
        failed_epoch: int | None = None,
        step_time: float | None = None,
        failure: str | None = None,
    ) -> Future[dict[str, Any]]:
        """Asks for the quorum of ``step``; the future resolves with the coordinator's answer.

        ``failure``: the error text of the exchange that failed in ``failed_epoch``, from which
        the coordinator tells a configuration error from a fault. An epoch the coordinator
        pushed (:class:`~unbroken.control.protocol.EpochPush`) that answers this request is the
        answer, at once, and nothing is sent."""
        self.step = step
        req_id = next(self._ids)
        fut: Future[dict[str, Any]] = Future()
        msg = protocol.QuorumAsk(
            id=req_id, step=step, step_time=step_time, failed_epoch=failed_epoch, failure=failure
        ).to_msg()
        with self._lock:  # one section with the push's arrival: a request is answered by it or sent
            pushed, self._pushed = self._pushed, None
            taken = pushed is not None and self._answers(pushed, step, failed_epoch)
            if not taken:
                if not self._pending:
                    self._quiet_since = time.monotonic()
                self._pending[req_id] = (msg, fut)
        if pushed is not None and taken:
            fut.set_result({**pushed, "id": req_id})
            return fut
        self._send(msg)
        return fut

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Returns once every line that had reached this process is handled (an abort among
        them has been passed to ``on_abort``), or after ``timeout_s``.

        The connection thread may not have run yet when the training thread is about to commit a
        step: after a ``SIGSTOP`` both resume at once, with the coordinator's abort of the epoch
        waiting in the socket. Committing before reading it would apply a step its peers gave up
        on (:mod:`unbroken.train.step.vote`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._reading.acquire(timeout=max(0.0, deadline - time.monotonic())):
                log.warning(
                    "the coordinator connection was still busy after %.2fs: committing without draining it", timeout_s
                )
                return
            try:
                sock = self._sock
                if sock is None:
                    return
                poll = select.poll()  # not select.select: a descriptor past 1023 is common in a large job
                try:
                    poll.register(sock, select.POLLIN)
                    waiting = bool(poll.poll(0))
                except (OSError, ValueError):  # closed under us: nothing more will be read from it
                    return
            finally:
                self._reading.release()
            if not waiting:
                return
            if time.monotonic() > deadline:
                log.warning("lines from the coordinator still unread after %.2fs: committing without them", timeout_s)
                return
            time.sleep(0.001)  # the connection thread reads them

    def next_step_after(self, epoch: int) -> int | None:
        """The step the epoch pushed with the abort of ``epoch`` (or of a later one) trains; None
        when no such push came (an abort alone, or none)."""
        after = self._pushed_after
        return after[1] if after is not None and after[0] >= epoch else None

    def _answers(self, pushed: dict[str, Any], step: int, failed_epoch: int | None) -> bool:
        d = QuorumDecision.from_json(pushed["decision"])
        return push_answers(d, self.hello.replica, step, failed_epoch)

    def close(self, finished: bool = True) -> None:
        """Says goodbye (a finished replica is not a failed one) and stops the thread."""
        if finished:
            self._send(protocol.Bye().to_msg())
        self._closed.set()
        self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()

    # -- connection thread ---------------------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            with self._lock:  # one sealed line at a time: their MACs count in wire order
                sock, session = self._sock, self._session
                if sock is None or session is None:
                    return  # re-sent on reconnect
                sock.sendall(protocol.encode(msg, session))
                self._last_sent = time.monotonic()
        except OSError:
            pass  # the connection thread notices and reconnects

    def _connect(self) -> tuple[socket.socket, Session] | None:
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay = 0.05
        # With standbys, a refused address is the next one's cue: the wait between rounds stays
        # short, so a takeover is noticed within a fraction of a second.
        max_delay = 1.0 if len(self.addresses) == 1 else 0.1
        first = self.addresses.index((self.host, self.port))
        # A hung coordinator accepts a connection (its kernel does) and then stalls the
        # handshake for its whole timeout: the one left for silence is skipped for a while.
        hung, hung_until = (self.addresses[first], time.monotonic() + HUNG_SKIP_S) if self._hop else (None, 0.0)
        self._hop = False
        for attempt in itertools.count():
            if self._closed.is_set() or time.monotonic() >= deadline:
                break
            self.host, self.port = self.addresses[(first + attempt) % len(self.addresses)]
            if (self.host, self.port) != hung or time.monotonic() >= hung_until:
                try:
                    sock, session = protocol.connect(self.host, self.port, self.secret, timeout=5.0)
                    sock.settimeout(None)
                    hello = dataclasses.replace(self.hello, step=self.step, epoch=self.epoch).to_msg()
                    sock.sendall(protocol.encode(hello, session))
                    return sock, session
                except AuthError as e:
                    log.warning("the coordinator at %s:%d did not authenticate (%s); retrying", self.host, self.port, e)
                except OSError:
                    pass
            if (attempt + 1) % len(self.addresses) == 0:  # every address tried once: wait, then again
                time.sleep(delay)
                delay = min(delay * 2, max_delay)
        return None

    def _run(self) -> None:
        while not self._closed.is_set():
            connected = self._connect()
            if connected is None:
                self._fail_pending(
                    CoordinatorUnreachable(
                        f"lost the coordinator at {self.host}:{self.port} for " f"{self.reconnect_timeout_s:.0f}s"
                    )
                )
                return
            sock, session = connected
            self._last_answer = None  # a short answer completes only one from the same connection
            self._conn_term = None  # until its welcome says
            with self._lock:
                self._pushed = None  # the next request goes to this connection's coordinator
                self._sock, self._session = sock, session
                resend = [m for (m, _) in self._pending.values()]
            for m in resend:
                self._send(m)
            try:
                self._serve(sock, session)
            except Exception:  # a bug here must not leave the replica without its coordinator
                log.exception("the coordinator connection failed; reconnecting")
            self.silence.disconnected()
            with self._lock:
                self._sock = self._session = None
            welcomed = self._connected.is_set()
            self._connected.clear()
            sock.close()
            if not welcomed and not self._closed.is_set():
                time.sleep(0.2)  # refused (this rank's old connection still lives): not a busy loop

    def _serve(self, sock: socket.socket, session: Session) -> None:
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        buf = b""
        bad = 0
        next_beat = 0.0
        self._quiet_since = time.monotonic()
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if len(self.addresses) > 1 and self._pending and now - self._quiet_since > self.coordinator_silent_s:
                    log.warning(
                        "the coordinator at %s:%d said nothing for %.1fs while a request waits (hung?): "
                        "trying the next address",
                        self.host,
                        self.port,
                        now - self._quiet_since,
                    )
                    self._hop = True
                    return
                if now >= next_beat:
                    self.silence.beat(now)
                    beat = protocol.Heartbeat(step=self.step, compute_s=self.compute_s)
                    if self.telemetry is not None:  # one line: the batch carries the heartbeat
                        self._send(protocol.Telemetry(beat, self.telemetry().to_msg()).to_msg())
                    elif heartbeat_due(now, self._last_sent, self.heartbeat_s):
                        self._send(beat.to_msg())
                    next_beat = now + self.heartbeat_s
                if not sel.select(timeout=max(0.0, next_beat - now)):
                    continue
                with self._reading:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    self._quiet_since = time.monotonic()
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        try:
                            ok = self._handle_line(line, session)
                        except AuthError as e:
                            log.warning("a line from the coordinator failed its MAC (%s): reconnecting", e)
                            return
                        except OutOfStep as e:
                            log.warning("%s: reconnecting", e)
                            return
                        if not ok:
                            bad += 1
                            if bad >= MAX_BAD_LINES:
                                log.warning("%d malformed lines from the coordinator: reconnecting", bad)
                                return
                if len(buf) > protocol.MAX_LINE:
                    log.warning("a line of more than %d bytes from the coordinator: reconnecting", protocol.MAX_LINE)
                    return
        except OSError:
            return
        finally:
            sel.close()

    def _handle_line(self, line: bytes, session: Session) -> bool:
        """Handles one line; False (logged, skipped) if it is malformed; AuthError if forged."""
        try:
            self._handle(protocol.decode(line, session))
        except (AuthError, OutOfStep):
            raise
        except (ValueError, TypeError, KeyError, OverflowError) as e:
            log.warning("malformed line from the coordinator skipped (%s): %r", e, line[:80])
            return False
        except Exception:
            log.exception("a message from the coordinator could not be handled; skipped")
        return True

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == protocol.Welcome.OP:
            welcome = protocol.Welcome.from_msg(msg)
            if welcome.term is not None:
                if self.term is not None and welcome.term < self.term:
                    self._hop = True  # the next address first: this one was replaced
                    raise StaleTerm(
                        f"the coordinator at {self.host}:{self.port} holds term {welcome.term}, older than "
                        f"term {self.term} this client was answered in"
                    )
                self.term = welcome.term
            self._conn_term = welcome.term
            self.store_address = welcome.store
            if welcome.heartbeat_s is not None:  # the coordinator's pace for a job of its size
                self.heartbeat_s = min(max(welcome.heartbeat_s, MIN_HEARTBEAT_S), MAX_HEARTBEAT_S)
            if welcome.timeout_s:
                self.silence.limit_s = welcome.timeout_s / 2
                # A large job's coordinator may be busy longer (its timeouts grow with the job):
                # no rank leaves it, and is evicted for that, over a burst of work.
                self.coordinator_silent_s = silent_after(welcome.timeout_s)
            self._connected.set()
        elif op == protocol.QuorumAnswer.OP:
            self._answer(msg)
        elif op == protocol.EpochPush.OP:
            self._push(msg)
        elif op == protocol.Abort.OP and self.on_abort is not None:
            self.on_abort(protocol.Abort.from_msg(msg).epoch)
        elif op == protocol.Donate.OP and self.on_donate is not None:
            self.on_donate(protocol.Donate.from_msg(msg).to)
        elif op == protocol.Prepare.OP and self.on_prepare is not None:
            self._prepare(protocol.Prepare.from_msg(msg))
        elif op == protocol.Alive.OP:
            protocol.Alive.from_msg(msg)  # heard: all it says (see COORDINATOR_SILENT_S)
        elif op == protocol.Error.OP:
            log.warning("coordinator: %s", protocol.Error.from_msg(msg).message)

    def _prepare(self, p: protocol.Prepare) -> None:
        """A forecast epoch (:class:`~unbroken.control.protocol.Prepare`): its members checked, its
        store defaulting as a quorum answer's does; handed to ``on_prepare``."""
        assert self.on_prepare is not None
        members = members_of_runs(p.member_runs)  # ValueError: skipped as a malformed line
        self.on_prepare(p.epoch, list(members), p.store or self.store_address or "")

    def _answer(self, msg: dict[str, Any]) -> None:
        """A quorum answer (:class:`~unbroken.control.protocol.QuorumAnswer` in full, or
        :class:`~unbroken.control.protocol.QuorumSame`): resolves the request it answers."""
        try:
            msg = protocol.expand_answer(msg, self._last_answer)
        except ValueError as e:
            raise OutOfStep(str(e)) from e
        msg = {**msg, "decision": listed_decision(msg.get("decision")), "term": self._conn_term}
        self._last_answer = msg
        self.epoch = protocol.count(msg["decision"], "epoch")
        store = msg.get("store", self.store_address)
        if not isinstance(store, str):
            raise ValueError("a store address that is no string")
        self.store_address = store
        with self._lock:
            entry = self._pending.pop(protocol.count(msg, "id"), None)
        if entry is not None:
            entry[1].set_result(msg)

    def _push(self, msg: dict[str, Any]) -> None:
        """The next epoch, pushed with the abort of the broken one: the answer to the request in
        flight that it answers (sent before the push arrived), else kept for the next request."""
        push = protocol.EpochPush.from_msg(msg)
        decision = listed_decision(push.decision)
        answer = {
            "id": 0,
            "decision": decision,
            "transfer_addrs": push.transfer_addrs,
            "store": push.store,
            "term": self._conn_term,
        }
        self._last_answer = answer  # the short answers of this epoch complete from it
        self.epoch = protocol.count(decision, "epoch")
        self._pushed_after = (push.abort, protocol.count(decision, "step"))
        if push.store:
            self.store_address = push.store
        with self._lock:
            fits = [i for i, (m, _) in self._pending.items() if self._answers(answer, m["step"], m.get("failed_epoch"))]
            entry = self._pending.pop(fits[0]) if fits else None
            self._pushed = None if entry is not None else answer
        if entry is not None:
            entry[1].set_result({**answer, "id": fits[0]})
        if self.on_abort is not None:  # after the answer is in place: the aborted exchange asks at once
            self.on_abort(push.abort)

    def _fail_pending(self, exc: Exception) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for _, fut in pending.values():
            fut.set_exception(exc)


def listed_decision(data: object) -> dict[str, Any]:
    """The decision in ``data`` with its members listed (the wire has them as runs of ids);
    ValueError unless it is a quorum decision the training thread can act on."""
    if not isinstance(data, dict):
        raise ValueError("a quorum answer without a decision")
    d = QuorumDecision.from_json(data)
    ids = [*d.members, *d.behind, *(x for pair in d.donors for x in pair)]
    if (
        not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)
        or any(len(pair) != 2 for pair in d.donors)
        or not d.behind_set <= d.member_set
    ):
        raise ValueError(f"a malformed quorum decision: {data!r:.80}")
    listed = {k: v for k, v in data.items() if k not in ("member_runs", "behind_runs")}
    listed["members"], listed["behind"] = list(d.members), list(d.behind)
    return listed
