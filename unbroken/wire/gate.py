"""The accept loop of a threaded listener: key holders in, strangers held cheaply and shed.

A listener that gave each accepted connection a thread before it authenticated would let a
stranger's idle sockets pin its threads and fill its slots. A :class:`Gate` instead accepts on
one thread, waits for each connection's ticket (:func:`~unbroken.wire.auth.make_ticket`, the
first bytes a client sends) without blocking, and hands on only connections whose ticket is
valid; the rest cost a descriptor and a few bytes each, within the budget of
:class:`~unbroken.wire.admission.Admission` (newest first, per source, a whole-handshake
deadline), and are closed when it says so. Refusals are logged once per interval.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable

from unbroken.wire.admission import DEFAULT_POLICY, Admission, AdmissionPolicy, RefusalLog
from unbroken.wire.auth import REFUSE, TICKET_BYTES, AuthError, CheckedTicket, JobSecret, check_ticket

log = logging.getLogger(__name__)

ACCEPTS_PER_ROUND = 32  # then the pending connections' tickets are read: a flood cannot starve them
WANT_DESCRIPTORS = 1 << 16  # a process's soft limit is raised toward this (within its hard limit)
Admitted = Callable[[socket.socket, bytes], None]


def raise_descriptor_limit(want: int = WANT_DESCRIPTORS) -> int:
    """Raises this process's soft limit on open descriptors toward ``want``, within the hard
    limit; returns the soft limit now. A process serving several listeners may hold a few
    hundred strangers' connections each, and the common soft default (1,024) would then run
    out, failing everything else the process opens (event logs, a replica's pipes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return int(soft)


class FirstBytes:
    """What a connection must send before a :class:`Gate` hands it on."""

    refusal = b""  # sent to a connection whose first bytes are refused

    def more(self, buf: bytes) -> int:
        """How many more bytes to read at most (0: ``buf`` is complete); ValueError if it never will be."""
        raise NotImplementedError

    def check(self, buf: bytes) -> None:
        """AuthError (or ValueError) when ``buf`` does not earn its connection a place."""
        raise NotImplementedError


class Ticket(FirstBytes):
    """A key holder's ticket for ``purpose`` (:func:`~unbroken.wire.auth.make_ticket`), taken
    once (:data:`~unbroken.wire.auth.TICKETS`): a replayed one is refused here."""

    refusal = REFUSE

    def __init__(self, secret: JobSecret, purpose: str) -> None:
        self._secret, self._purpose = secret, purpose

    def more(self, buf: bytes) -> int:
        return TICKET_BYTES - len(buf)

    def check(self, buf: bytes) -> None:
        check_ticket(self._secret, self._purpose, buf)


class Gate:
    """Accepts ``sock``'s connections on a thread of its own and passes each that sends a valid
    ticket to ``admitted(conn, ticket)`` (blocking mode, on the gate's thread: start a thread
    there, do not serve). The gate owns ``sock`` from now on: :meth:`close` closes it.

    Args:
        sock: a listening socket.
        secret: the job's secret, to check tickets.
        purpose: the listener's name in the handshake ("store", "transfer", ...).
        admitted: called with each key holder's connection and its ticket.
        name: the thread's name.
        policy: the budget of connections that have not shown a ticket yet.
        clock: monotonic seconds (tests pass their own).
        first: what a connection must send instead of a ticket (the HTTP server: a whole
            request head); ``secret`` may then be None.
    """

    def __init__(
        self,
        sock: socket.socket,
        secret: JobSecret | None,
        purpose: str,
        admitted: Admitted,
        name: str,
        policy: AdmissionPolicy = DEFAULT_POLICY,
        clock: Callable[[], float] = time.monotonic,
        first: FirstBytes | None = None,
    ) -> None:
        if first is None:
            if secret is None:
                raise TypeError("a Gate checks tickets with the job's secret: pass secret (or first)")
            first = Ticket(secret, purpose)
        self._sock, self._first, self._purpose, self._admitted = sock, first, purpose, admitted
        self._clock = clock
        raise_descriptor_limit()
        self.admission: Admission[socket.socket] = Admission(policy)
        self.refusals = RefusalLog(log, f"the {purpose} listener shed or refused connections")
        self.refused = 0  # connections whose ticket was wrong (not a key holder)
        self.shed = 0  # connections closed for a newer one or past the deadline
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Connections held now that have not shown a ticket."""
        return len(self.admission)

    def close(self) -> None:
        """Stops accepting, closes the listening socket and every pending connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _run(self) -> None:
        try:
            while not self._closed:
                deadline = self.admission.next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - self._clock())
                for key, _ in self._sel.select(timeout):
                    if key.fileobj is self._sock:
                        self._accept_some()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        self._read(key.fileobj, key.data)  # type: ignore[arg-type]  # our own sockets
                for conn in self.admission.expired(self._clock()):
                    self._drop(conn, f"no ticket within {self.admission.policy.deadline_s} s")
        except Exception:  # a bug here would silently stop the listener: say so
            log.exception("the %s listener's gate stopped", self._purpose)
            raise
        finally:
            for key in list(self._sel.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]  # sockets only
            self._sel.close()
            self._wake_w.close()

    def _accept_some(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                conn, addr = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of descriptors: shed the oldest stranger to make room
                if self._closed:
                    return
                self.refusals.note(f"accept failed: {e}", self._clock())
                oldest = self.admission.oldest()
                if oldest is not None:
                    self.admission.release(oldest)
                    self._drop(oldest, "shed: out of descriptors")
                else:
                    time.sleep(0.01)
                return
            conn.setblocking(False)
            source = str(addr[0]) if isinstance(addr, tuple) else str(addr)
            for victim in self.admission.admit(conn, source, self._clock()):
                self._drop(victim, "shed for a newer connection (too many without a ticket)")
            self._sel.register(conn, selectors.EVENT_READ, bytearray())

    def _read(self, conn: socket.socket, buf: bytearray) -> None:
        try:
            data = conn.recv(self._first.more(bytes(buf)))
        except BlockingIOError:
            return
        except (OSError, ValueError):
            data = b""
        if not data:
            self.admission.release(conn)
            self._drop(conn, None)
            return
        buf += data
        try:
            if self._first.more(bytes(buf)) > 0:
                return
        except ValueError:
            pass  # refused by check() below
        self._sel.unregister(conn)
        self.admission.release(conn)
        try:
            self._first.check(bytes(buf))
        except (AuthError, ValueError) as e:
            self.refused += 1  # counted before the client can learn of it
            with contextlib.suppress(OSError):
                conn.send(self._first.refusal)
            self._close(conn)
            self.refusals.note(str(e), self._clock())
            return
        first = bytes(buf)
        try:
            conn.setblocking(True)
            self._admitted(conn, CheckedTicket(first) if isinstance(self._first, Ticket) else first)
        except Exception:
            log.exception("the %s listener could not take a connection", self._purpose)
            self._close(conn)

    def _drop(self, conn: socket.socket, reason: str | None) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn)
        self._close(conn)
        if reason is not None:
            self.shed += 1
            self.refusals.note(reason, self._clock())

    @staticmethod
    def _close(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.close()
