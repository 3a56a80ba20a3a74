"""The job's secret, and mutual authentication of every connection that carries the job.

Threat model: anyone who can reach a port (another user on a shared node, a process of another
job, a scanner) must not join the job, speak for a replica, read its state or push it
checkpoints. Every listener runs :func:`server_handshake` before it reads anything else and
every client runs :func:`client_handshake`: each side proves it holds the job's secret with
HMAC-SHA256 over fresh nonces from both sides (nothing can be replayed from an earlier
connection), and both derive one key per direction for this connection. The client speaks
first, with a ticket (a MAC of its nonce and the time, :func:`make_ticket`): a listener then
tells a key holder from a stranger in the bytes that arrive with the connection, before it
answers or spends a thread, and keeps its slots for key holders while strangers flood it
(:mod:`unbroken.wire.admission`). A ticket is good once, within :data:`TICKET_WINDOW_S` of its
time (:class:`TicketLedger`): one seen on the wire cannot be replayed to take a listener's
key-holder slots. Control messages then
carry a MAC over an implicit sequence number (:class:`Session`), so none can be forged,
replayed, reordered or reflected back to its sender.

Bulk tensor streams (catch-up, peer checkpoints) are bound to the authenticated connection and
checked by CRC-32C rather than MACed byte by byte: an attacker who can inject packets into an
established TCP connection (on the path) is out of scope, as for torch.distributed's own
transports (Gloo, NCCL); a private fabric or IPsec/WireGuard covers that case.

The secret lives in a file readable only by its owner (``UNBROKEN_SECRET_FILE``): an environment
variable holding the key itself would show in ``/proc/PID/environ`` of every child, core dumps
and job-scheduler logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import hmac
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from unbroken import config
from unbroken.config import ENV_SECRET_FILE, ConfigError

SECRET_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 16
_MAGIC = b"UNBK\x00\x03"  # protocol name and version: a mismatched peer fails at once, clearly
TICKET_MAGIC = _MAGIC  # how every ticket starts (what a flood's wrong tickets imitate)
_PROOF_BYTES = 32
_ISSUED_BYTES = 8  # a ticket's time: milliseconds since the epoch, big-endian
TICKET_BYTES = len(_MAGIC) + NONCE_BYTES + _ISSUED_BYTES + TAG_BYTES
# A ticket is taken once, within this many seconds either side of the listener's clock: the
# clocks of a job's machines must agree within it (NTP keeps them within milliseconds).
TICKET_WINDOW_S = 300.0
TICKET_MEMORY = 1 << 16  # tickets a process remembers at most (about 10 MiB when full); see TicketLedger
ACCEPT, REFUSE = b"Y", b"N"  # a listener's first byte: what it made of the ticket
_ANSWER_BYTES = 1 + NONCE_BYTES + _PROOF_BYTES
HANDSHAKE_TIMEOUT_S = 10.0


class AuthError(ConnectionError):
    """The peer does not hold the job's secret, or a message failed its MAC."""


class HandshakeInterrupted(AuthError):
    """The peer closed the connection mid-handshake: a listener shedding load does that, so
    (unlike a refusal) trying again later can succeed."""


class JobSecret:
    """The per-job key. Its ``repr`` never shows the key (it ends up in logs and tracebacks)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < SECRET_BYTES:
            raise ConfigError(f"a job secret needs at least {SECRET_BYTES} bytes, got {len(key)}")
        self._key = bytes(key)

    @property
    def key(self) -> bytes:
        return self._key

    def __repr__(self) -> str:
        return "JobSecret(<redacted>)"

    @classmethod
    def generate(cls) -> JobSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    def write(self, path: str | os.PathLike[str], replace: bool = False) -> Path:
        """Writes the key as hex to a file that only its owner can read, atomically: to a temporary
        file beside it, synced, then moved into place, so a crash or a full disk leaves the path
        as it was (never empty or half written). Never overwrites (FileExistsError) unless
        ``replace``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self._key.hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            if replace:
                os.replace(tmp, path)
            else:
                _link_new(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        _sync_dir(path.parent)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> JobSecret:
        """Reads a secret file; refuses one that others can read or that another user owns."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ConfigError(f"cannot read the job secret file {path}: {e.strerror}") from e
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(
                    f"the job secret file {path} is readable by others (mode "
                    f"{stat.S_IMODE(st.st_mode):o}): run `chmod 600 {path}`"
                )
            if st.st_uid != os.geteuid():
                raise ConfigError(f"the job secret file {path} belongs to uid {st.st_uid}, not to this user")
            text = f.read(4 * SECRET_BYTES + 2).strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(
                f"the job secret file {path} must hold {SECRET_BYTES} or more bytes as hex "
                "(create one with `unbroken secret new PATH`)"
            ) from None
        return cls(key)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobSecret | None:
        """The secret named by ``UNBROKEN_SECRET_FILE``, or None when that is unset."""
        path = config.secret_file(env)
        return cls.load(path) if path else None

    @classmethod
    def required(cls, env: Mapping[str, str] | None = None) -> JobSecret:
        """The secret named by ``UNBROKEN_SECRET_FILE``; a clear error when it is unset."""
        secret = cls.from_env(env)
        if secret is None:
            raise ConfigError(
                f"{ENV_SECRET_FILE} is not set: start the process with `unbroken run` (which makes "
                "a secret per job), or point it at the job's secret file (`--secret-file`)"
            )
        return secret


def _link_new(tmp: Path, path: Path) -> None:
    """``tmp`` at ``path`` too, atomically; FileExistsError if ``path`` exists."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: not atomic against a racing writer
        if path.exists():
            raise FileExistsError(f"{path} exists already") from None
        os.replace(tmp, path)


def _sync_dir(directory: Path) -> None:
    """Makes a rename in ``directory`` durable (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Session:
    """One authenticated connection's message keys and sequence numbers.

    A MAC covers the direction's sequence number and the payload; the numbers are implicit
    (both sides count), so a dropped, replayed or reordered message fails verification. Not
    thread-safe: one sender and one receiver at a time, as every connection here has.
    """

    __slots__ = ("_send_key", "_recv_key", "_send_seq", "_recv_seq")

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = self._recv_seq = 0

    def tag(self, payload: bytes) -> bytes:
        """The MAC of the next message sent; advances the send sequence."""
        seq = self._send_seq.to_bytes(8, "big")
        self._send_seq += 1
        return hmac.digest(self._send_key, seq + payload, "sha256")[:TAG_BYTES]

    def check(self, payload: bytes, tag: bytes) -> None:
        """Verifies the MAC of the next message received; AuthError if it does not match."""
        seq = self._recv_seq.to_bytes(8, "big")
        self._recv_seq += 1
        if not hmac.compare_digest(hmac.digest(self._recv_key, seq + payload, "sha256")[:TAG_BYTES], tag):
            raise AuthError("a message failed its MAC (forged, replayed or altered)")

    def seal_line(self, payload: bytes) -> bytes:
        """``payload`` (one line of text, no newline) with its MAC appended, and a newline."""
        return payload + b" " + self.tag(payload).hex().encode() + b"\n"

    def open_line(self, line: bytes) -> bytes:
        """The payload of a sealed line; AuthError if the MAC is missing or wrong."""
        payload, sep, tag_hex = line.rstrip(b"\r\n").rpartition(b" ")
        try:
            tag = bytes.fromhex(tag_hex.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            tag = b""
        if not sep or len(tag) != TAG_BYTES:
            self._recv_seq += 1  # the stream is out of step either way: every later line fails too
            raise AuthError("a message arrived without a valid MAC")
        self.check(payload, tag)
        return payload


def _proof(key: bytes, role: bytes, purpose: str, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.digest(key, role + purpose.encode() + b"\x00" + nonce_s + nonce_c, "sha256")


def _session(key: bytes, purpose: str, nonce_s: bytes, nonce_c: bytes, *, server: bool) -> Session:
    base = hmac.digest(key, b"session" + purpose.encode() + b"\x00" + nonce_s + nonce_c, "sha256")
    c2s = hmac.digest(base, b"client->server", hashlib.sha256)
    s2c = hmac.digest(base, b"server->client", hashlib.sha256)
    return Session(send_key=s2c, recv_key=c2s) if server else Session(send_key=c2s, recv_key=s2c)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeInterrupted("the peer closed the connection during authentication")
        buf += chunk
    return bytes(buf)


class CheckedTicket(bytes):
    """A ticket a :class:`~unbroken.wire.gate.Gate` took already (MAC, time, once): the
    handshake it is handed to checks its MAC again, not whether it was seen."""


class TicketLedger:
    """The tickets this process's listeners took within :data:`TICKET_WINDOW_S`: each is taken
    once, so one seen on the wire cannot be replayed (a ticket only admits a connection to the
    handshake, whose proofs over the listener's nonce a replay fails; but a replayed ticket
    would take a key holder's slot and thread for the handshake's timeout, as often as sent).

    Bounded: at most ``capacity`` tickets are remembered. Past that, the oldest is forgotten
    and every ticket issued no later than it is refused from then on (the floor), so a
    forgotten ticket cannot come back. Thread-safe: gates, threads and an event loop share it.
    """

    def __init__(
        self,
        window_s: float = TICKET_WINDOW_S,
        capacity: int = TICKET_MEMORY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window_s, self.capacity, self._clock = window_s, capacity, clock
        self._seen: dict[bytes, float] = {}
        self._by_time: list[tuple[float, bytes]] = []  # a heap, oldest issue first
        self._floor = float("-inf")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def take(self, nonce: bytes, issued: float, purpose: str) -> None:
        """Takes the ticket of ``nonce`` issued at ``issued`` (seconds since the epoch), or
        raises AuthError: replayed, or outside the window (replayed later, or the clocks differ)."""
        now = self._clock()
        if abs(now - issued) > self.window_s:
            raise AuthError(
                f"a ticket for the {purpose} listener was issued {issued - now:+.0f} s from this machine's "
                f"time: replayed, or the client's clock and this machine's differ by more than "
                f"{self.window_s:.0f} s (keep the job's machines on NTP)"
            )
        with self._lock:
            while self._by_time and self._by_time[0][0] < now - self.window_s:
                _, old = heapq.heappop(self._by_time)
                del self._seen[old]
            if nonce in self._seen:
                raise AuthError(f"a ticket for the {purpose} listener was replayed (it was taken before)")
            while len(self._seen) >= self.capacity:
                t, old = heapq.heappop(self._by_time)
                del self._seen[old]
                self._floor = max(self._floor, t)
            if issued <= self._floor:
                raise AuthError(
                    f"a ticket for the {purpose} listener is older than the {self.capacity} it remembers "
                    "(replayed, or its client's clock lags this machine's)"
                )
            self._seen[nonce] = issued
            heapq.heappush(self._by_time, (issued, nonce))


TICKETS = TicketLedger()  # one per process: every listener's tickets


def make_ticket(secret: JobSecret, purpose: str, now: float | None = None) -> tuple[bytes, bytes]:
    """``(ticket, client nonce)``: the first bytes a client sends, before the listener says anything.

    The ticket is a MAC of a fresh nonce and the time under the job's key: a listener that
    reads it knows at once, without a round trip or a thread, that this connection comes from a
    key holder, and so admits it ahead of the strangers flooding it
    (:mod:`unbroken.wire.admission`). A listener takes each ticket once, within
    :data:`TICKET_WINDOW_S` of its time (:class:`TicketLedger`), so one seen on the wire cannot
    be replayed to take its slots; the proofs over the listener's nonce that follow are what
    authenticate.
    """
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    issued = int((time.time() if now is None else now) * 1000).to_bytes(_ISSUED_BYTES, "big")
    return _MAGIC + nonce_c + issued + _ticket_mac(secret.key, purpose, nonce_c + issued), nonce_c


def _ticket_mac(key: bytes, purpose: str, signed: bytes) -> bytes:
    return hmac.digest(key, b"ticket" + purpose.encode() + b"\x00" + signed, "sha256")[:TAG_BYTES]


def check_ticket(secret: JobSecret, purpose: str, ticket: bytes, ledger: TicketLedger | None = TICKETS) -> bytes:
    """The client nonce of a valid ticket (:func:`make_ticket`), taken in ``ledger`` (None: its
    MAC only, for a ticket taken already); AuthError otherwise."""
    if len(ticket) != TICKET_BYTES or ticket[: len(_MAGIC)] != _MAGIC:
        raise AuthError(f"a client of the {purpose} listener does not speak unbroken's authentication")
    signed = ticket[len(_MAGIC) : -TAG_BYTES]
    if not hmac.compare_digest(ticket[-TAG_BYTES:], _ticket_mac(secret.key, purpose, signed)):
        raise AuthError(f"a client failed to authenticate to the {purpose} listener")
    nonce_c = signed[:NONCE_BYTES]
    if ledger is not None:
        ledger.take(nonce_c, int.from_bytes(signed[NONCE_BYTES:], "big") / 1000, purpose)
    return nonce_c


def _given(ticket: bytes) -> TicketLedger | None:
    """The ledger a handshake takes a ticket handed to it in: none if a gate took it."""
    return None if isinstance(ticket, CheckedTicket) else TICKETS


def _server_hello(secret: JobSecret, purpose: str, nonce_c: bytes) -> tuple[bytes, bytes]:
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    return ACCEPT + nonce_s + _proof(secret.key, b"server", purpose, nonce_s, nonce_c), nonce_s


def _check_client(secret: JobSecret, purpose: str, nonce_s: bytes, nonce_c: bytes, proof_c: bytes) -> Session:
    if not hmac.compare_digest(proof_c, _proof(secret.key, b"client", purpose, nonce_s, nonce_c)):
        raise AuthError(f"a client failed to authenticate to the {purpose} listener")
    return _session(secret.key, purpose, nonce_s, nonce_c, server=True)


def _check_server(secret: JobSecret, purpose: str, nonce_c: bytes, answer: bytes) -> tuple[bytes, bytes]:
    """``(server nonce, the client's proof to send)`` from the listener's answer to a ticket."""
    if answer[:1] != ACCEPT:
        raise AuthError(
            f"the {purpose} listener refused this client: it does not hold this job's secret, speaks "
            f"another version of unbroken, or its clock and this machine's differ by more than "
            f"{TICKET_WINDOW_S:.0f} s"
        )
    nonce_s, proof_s = answer[1 : 1 + NONCE_BYTES], answer[1 + NONCE_BYTES :]
    if not hmac.compare_digest(proof_s, _proof(secret.key, b"server", purpose, nonce_s, nonce_c)):
        raise AuthError(f"the {purpose} listener failed to authenticate: it does not hold this job's secret")
    return nonce_s, _proof(secret.key, b"client", purpose, nonce_s, nonce_c)


def no_delay(sock: socket.socket) -> None:
    """Sends each write at once (TCP_NODELAY) on a TCP socket; nothing on any other.

    Every connection of the job is small writes answered by reads: the handshake's proof and
    then the first request are two writes before the client reads, and with Nagle's algorithm
    the second waits for the peer's delayed ACK of the first, 40 ms on Linux. That was most of
    a catch-up's 60 ms fetch of 25 MB on one machine (the handshake alone 41 ms). Gloo and
    TCPStore set it on their sockets too; asyncio's streams set it by default.
    """
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def server_handshake(
    sock: socket.socket,
    secret: JobSecret,
    purpose: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ticket: bytes | None = None,
) -> Session:
    """Authenticates a freshly accepted connection (and this listener to it); AuthError if not.
    Sets TCP_NODELAY on it (:func:`no_delay`).

    ``purpose`` names the listener ("coordinator", "transfer", ...): a handshake made for one
    cannot be used against another. ``ticket``: the client's first bytes when a
    :class:`~unbroken.wire.gate.Gate` has read them already (a :class:`CheckedTicket`: taken
    there) or the listener has (taken here, once).
    """
    no_delay(sock)
    old = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        if ticket is None:
            ticket = _recv(sock, TICKET_BYTES)
        try:
            nonce_c = check_ticket(secret, purpose, ticket, _given(ticket))
        except AuthError:
            with contextlib.suppress(OSError):
                sock.sendall(REFUSE)
            raise
        hello, nonce_s = _server_hello(secret, purpose, nonce_c)
        sock.sendall(hello)
        return _check_client(secret, purpose, nonce_s, nonce_c, _recv(sock, _PROOF_BYTES))
    except TimeoutError as e:
        raise AuthError(f"a client did not authenticate to the {purpose} listener in {timeout_s} s") from e
    finally:
        sock.settimeout(old)


def client_handshake(
    sock: socket.socket, secret: JobSecret, purpose: str, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> Session:
    """Authenticates this client to a listener and the listener to it; AuthError if either fails.
    Sets TCP_NODELAY on the socket (:func:`no_delay`).

    HandshakeInterrupted (an AuthError) when the listener closed the connection before
    answering: an overloaded listener sheds connections that way, so a retry may succeed.
    """
    no_delay(sock)
    old = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        ticket, nonce_c = make_ticket(secret, purpose)
        sock.sendall(ticket)
        first = _recv(sock, 1)
        answer = first + (_recv(sock, _ANSWER_BYTES - 1) if first == ACCEPT else b"")
        nonce_s, proof_c = _check_server(secret, purpose, nonce_c, answer)
        sock.sendall(proof_c)
        return _session(secret.key, purpose, nonce_s, nonce_c, server=False)
    except TimeoutError as e:
        raise AuthError(f"the {purpose} listener did not authenticate in {timeout_s} s") from e
    except (ConnectionResetError, BrokenPipeError) as e:
        raise HandshakeInterrupted(f"the {purpose} listener closed the connection during authentication") from e
    finally:
        sock.settimeout(old)


async def server_handshake_async(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: JobSecret,
    purpose: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ticket: bytes | None = None,
) -> Session:
    """:func:`server_handshake` for an asyncio listener."""

    async def run() -> Session:
        try:
            data = ticket if ticket is not None else await reader.readexactly(TICKET_BYTES)
            try:
                nonce_c = check_ticket(secret, purpose, data, _given(data))
            except AuthError:
                writer.write(REFUSE)
                raise
            hello, nonce_s = _server_hello(secret, purpose, nonce_c)
            writer.write(hello)
            await writer.drain()
            proof_c = await reader.readexactly(_PROOF_BYTES)
        except asyncio.IncompleteReadError as e:
            raise HandshakeInterrupted("the peer closed the connection during authentication") from e
        return _check_client(secret, purpose, nonce_s, nonce_c, proof_c)

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise AuthError(f"a client did not authenticate to the {purpose} listener in {timeout_s} s") from e


async def client_handshake_async(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: JobSecret,
    purpose: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> Session:
    """:func:`client_handshake` for an asyncio connection."""

    async def run() -> Session:
        ticket, nonce_c = make_ticket(secret, purpose)
        try:
            writer.write(ticket)
            await writer.drain()
            first = await reader.readexactly(1)
            answer = first + (await reader.readexactly(_ANSWER_BYTES - 1) if first == ACCEPT else b"")
            nonce_s, proof_c = _check_server(secret, purpose, nonce_c, answer)
            writer.write(proof_c)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as e:
            raise HandshakeInterrupted(f"the {purpose} listener closed the connection during authentication") from e
        return _session(secret.key, purpose, nonce_s, nonce_c, server=False)

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise AuthError(f"the {purpose} listener did not authenticate in {timeout_s} s") from e
