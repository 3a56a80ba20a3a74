"""The sockets of the ICCL exchange: listeners per path, authenticated dials and accepts.

Every connection proves the job's secret both ways (:func:`~unbroken.wire.auth.server_handshake`,
purpose ``"iccl"``) and then names itself in one MACed hello (ring, sending rank, path); only the
ring's predecessor is accepted, on the path of the listener it reached. Each listening socket
sits behind a :class:`~unbroken.wire.gate.Gate`: a connection gets a thread only once its first
bytes are a key holder's ticket, so a stranger's idle or garbage sockets (the listener once let 4
of them take every handshake slot, and a ring could not form or fail over) are held within the
strangers' budget and shed, never in the ring's way. Chunks then flow
unMACed but CRC-checked, as catch-up's bulk bytes do (:mod:`unbroken.comm.catchup`): an on-path
attacker injecting packets into an established TCP connection is out of scope, as for Gloo.

Dead links are found by the kernel: ``TCP_USER_TIMEOUT`` fails a connection whose sent bytes stay
unacknowledged past the stall bound, while a peer that is only slow to read (its window closed,
its kernel still answering) is left alone; reads time out when a frame stops midway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import select
import socket
import struct
import threading
from collections.abc import Callable

from unbroken.comm.iccl.protocol import ProtocolError
from unbroken.config import parse_host_port
from unbroken.wire.auth import AuthError, JobSecret, client_handshake, server_handshake
from unbroken.wire.framing import FrameError, recv_sealed, send_sealed
from unbroken.wire.gate import Gate

log = logging.getLogger(__name__)

PURPOSE = "iccl"
MAX_HELLO = 1024
SOCKET_BUFFER = 4 << 20
POLL_S = 0.05  # an inbound read wakes this often to see whether the sender moved paths


@dataclasses.dataclass(frozen=True)
class PathAddrs:
    """A member's listening addresses, ``host:port`` each: its primary path and its backup."""

    primary: str
    backup: str

    def to_json(self) -> bytes:
        return json.dumps({"primary": self.primary, "backup": self.backup}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PathAddrs:
        """Parses what a member wrote to the rendezvous store; ValueError when malformed."""
        try:
            d = json.loads(raw)
            addrs = cls(str(d["primary"]), str(d["backup"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"a member's ICCL addresses are malformed: {raw[:200]!r}") from e
        for a in (addrs.primary, addrs.backup):
            parse_host_port(a, "ICCL address")
        return addrs

    def path(self, i: int) -> str:
        return self.backup if i else self.primary


def tune(sock: socket.socket, stall_s: float, buffer: int | None) -> None:
    """No Nagle delay, large buffers, and the kernel's bound on unacknowledged bytes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    with contextlib.suppress(OSError, AttributeError):  # Linux only
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(stall_s * 1000)))


def dial(
    address: str,
    secret: JobSecret,
    hello: dict[str, object],
    stall_s: float,
    timeout_s: float,
    buffer: int | None = SOCKET_BUFFER,
    handshake_s: float = 5.0,
) -> socket.socket:
    """An authenticated connection to a peer's listener, introduced by ``hello``; OSError or
    AuthError when the peer cannot be reached (in ``timeout_s``) or does not hold the secret.

    The handshake has its own, longer bound: a peer busy importing or collecting garbage may
    take a while to answer, and a dial given up too soon is retried forever."""
    host, port = parse_host_port(address, "ICCL address")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        tune(sock, stall_s, buffer)  # before connect: the window scale is agreed in the handshake
        sock.settimeout(timeout_s)
        sock.connect((host, port))
        session = client_handshake(sock, secret, PURPOSE, handshake_s)
        send_sealed(sock, session, json.dumps(hello).encode())
        sock.settimeout(None)  # sends block; the kernel's user timeout ends them on a dead link
        return sock
    except BaseException:
        sock.close()
        raise


# (path, rank, ring, socket) -> None: an authenticated connection arrived
OnConnection = Callable[[int, int, str, socket.socket], None]


class Listener:
    """One listening socket per path; authenticates what arrives and hands it to ``on_conn``.

    Made before the rendezvous (its addresses are what a member publishes); connections that
    arrive before the ring attaches wait, the latest per path. Each socket is accepted by a
    :class:`~unbroken.wire.gate.Gate` (see the module doc).
    """

    def __init__(
        self, secret: JobSecret, hosts: tuple[str, str], stall_s: float = 0.5, buffer: int | None = SOCKET_BUFFER
    ) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError(f"an ICCL listener needs the job's JobSecret, got {type(secret).__name__}")
        self._secret, self._stall_s, self._buffer = secret, stall_s, buffer
        self._socks: list[socket.socket] = []
        try:
            for host in hosts:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tune(s, stall_s, buffer)  # inherited by accepted sockets, before their handshake
                s.bind((host, 0))
                s.listen(16)
        except BaseException:
            self.close()
            raise
        self.addrs = PathAddrs(*("{}:{}".format(*s.getsockname()[:2]) for s in self._socks))
        self._lock = threading.Lock()
        self._on_conn: OnConnection | None = None
        self._early: dict[int, tuple[int, str, socket.socket]] = {}
        self._closed = False
        self._bad_hellos = 0
        self.gates: list[Gate] = []
        try:
            for path, s in enumerate(self._socks):
                self.gates.append(
                    Gate(
                        s,
                        secret,
                        PURPOSE,
                        functools.partial(self._start_admit, path=path),
                        name=f"unbroken-iccl-gate-{path}",
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def refused(self) -> int:
        """Connections refused: a wrong ticket at a gate, or a failed handshake or hello."""
        return self._bad_hellos + sum(g.refused for g in self.gates)

    def attach(self, on_conn: OnConnection) -> None:
        with self._lock:
            self._on_conn = on_conn
            early, self._early = self._early, {}
        for path, (rank, ring, sock) in early.items():
            on_conn(path, rank, ring, sock)

    def close(self) -> None:
        self._closed = True
        for g in self.gates:
            g.close()  # closes its socket and the connections that showed no ticket
        for s in self._socks[len(self.gates) :]:
            s.close()
        with self._lock:
            for _, _, sock in self._early.values():
                sock.close()
            self._early.clear()

    def _start_admit(self, conn: socket.socket, ticket: bytes, *, path: int) -> None:
        """A key holder's connection (its ticket checked by the gate): its handshake and hello
        on a thread of their own, off the gate's thread."""
        if self._closed:
            conn.close()
            return
        threading.Thread(target=self._admit, args=(conn, path, ticket), name="unbroken-iccl-admit", daemon=True).start()

    def _admit(self, conn: socket.socket, path: int, ticket: bytes) -> None:
        try:
            session = server_handshake(conn, self._secret, PURPOSE, ticket=ticket)
            conn.settimeout(10.0)
            hello = json.loads(recv_sealed(conn, session, MAX_HELLO))
            rank, ring, claimed = hello["rank"], hello["ring"], hello["path"]
            if type(rank) is not int or not isinstance(ring, str) or claimed != path:
                raise ValueError(f"bad hello {hello!r}")
        except (AuthError, FrameError, OSError, ValueError, KeyError, TypeError) as e:
            self._bad_hellos += 1
            log.warning("refused an ICCL connection on the %s path: %s", ("primary", "backup")[path], e)
            conn.close()
            return
        with self._lock:
            on_conn = self._on_conn
            if on_conn is None:
                old = self._early.pop(path, None)
                self._early[path] = (rank, ring, conn)
        if on_conn is None:
            if old is not None:
                old[2].close()
        else:
            on_conn(path, rank, ring, conn)


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking socket whose reads give up after ``seconds`` without a byte (the kernel's
    ``SO_RCVTIMEO``): unlike Python's own timeout, it lets one ``MSG_WAITALL`` read fill a
    whole chunk in one system call."""
    sock.settimeout(None)
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view``; FrameError if the peer closes first, OSError on a read timeout."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise FrameError(f"the peer closed the connection after {got} of {n} bytes")
        got += k


def send_all(sock: socket.socket, header: bytes, payload: memoryview | bytes) -> None:
    """One frame in as few system calls as the kernel allows, without joining the buffers."""
    total = len(header) + len(payload)
    sent = sock.sendmsg([header, payload])
    while sent < total:
        if sent < len(header):
            sent += sock.sendmsg([header[sent:], payload])
        else:
            sent += sock.send(payload[sent - len(header) :])


def read_inbound(
    sock: socket.socket, view: memoryview, other: Callable[[], socket.socket | None], bound_s: float
) -> None:
    """Fills ``view`` from an inbound connection (reads wake every :data:`POLL_S`), giving it up
    when the sender has moved to the other path (data waits on ``other()``: ProtocolError) or
    when no byte came for ``bound_s`` (TimeoutError): a frame stopped midway on a dead link must
    not hold the receiver while the chunks come again on the backup."""
    got, n, quiet = 0, len(view), 0.0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:
            quiet += POLL_S
            alt = other()
            if alt is not None and select.select([alt], [], [], 0)[0]:
                raise ProtocolError("the sender moved to the other path mid-frame") from None
            if quiet >= bound_s:
                raise TimeoutError(f"a frame stopped midway for {bound_s:.1f} s") from None
            continue
        if k == 0:
            raise FrameError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
        quiet = 0.0


def shut(sock: socket.socket) -> None:
    """Closes a connection now, waking any thread blocked on it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
