"""The peer tier: the newest snapshot of each shard kept in another process's memory.

Another replica (or the next node, TRANSOM-style ring) runs a :class:`PeerStore`; the persist
process of a shard pushes each committed snapshot to it, so a node that loses its memory and
its local disk can still restore from the peer. A store replaces an owner's copy only once a
new one has fully arrived and verified, so a sender that dies mid-transfer leaves the previous
copy intact. Only loopback addresses are bound by default.

Trust: a peer store holds the job's model and optimizer, and what it serves wins a restore.
So both sides prove they hold the job's secret (:func:`~unbroken.wire.auth.server_handshake`,
purpose ``"peer-checkpoint"``) before anything else, and every request and answer header is a
MACed frame; the bulk bytes are bound to that connection and checked against the CRCs of the
MACed manifest. A push is accepted only if it is whole and consistent: a valid manifest (the
checks of :func:`~unbroken.checkpoint.storage.manifest.validate`) with a CRC for every tensor and the
objects, byte counts equal to the manifest's, and every CRC matching; its sizes are bounded
(objects, one copy, all copies held, owners, connections) and every connection has a timeout.
Connections wait for their ticket in a :class:`~unbroken.wire.gate.Gate`, without a thread
and within a budget apart from key holders' slots, so a stranger's flood cannot shut out a push.

Which push wins: the newest push of an owner replaces its copy, whatever its step. Only
holders of the key can push, so a step is not a claim to be weighed against the others; and a
rolled-back job legitimately pushes lower steps (the old rule, keep the higher step, answered
such pushes "ok" and dropped them, so a peer kept serving the state the rollback undid). A push
that is refused is answered with the reason, never "ok".

Wire format, after the handshake: a sealed frame (a JSON header and its MAC). A ``put`` is
answered by a sealed frame saying "send" (or why not), then the raw bytes it announced follow,
then a sealed frame says whether the copy is held; a ``get`` is answered by a sealed frame and
the raw bytes it announces.
"""

from __future__ import annotations

import json
import re
import socket
import socketserver
import threading
from dataclasses import dataclass
from typing import Any

from unbroken.checkpoint.storage import checksum
from unbroken.checkpoint.storage.manifest import ShardManifest
from unbroken.wire.auth import AuthError, JobSecret, Session, client_handshake, server_handshake
from unbroken.wire.framing import recv_exact, recv_sealed, send_sealed
from unbroken.wire.gate import Gate

_TIMEOUT_S = 30.0
PURPOSE = "peer-checkpoint"
MAX_HEADER = 256 << 20  # a manifest of a million tensors
MAX_OBJECTS = 256 << 20  # the pickled non-tensor state of one shard
MAX_OWNERS = 4096
MAX_CONNECTIONS = 32  # authenticated, at once; strangers wait apart, in the gate
DEFAULT_MAX_BYTES = 64 << 30  # every copy held plus those arriving
_OWNER = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class PeerError(ConnectionError):
    """The peer store refused a request, failed authentication, or broke off the transfer."""


@dataclass
class PeerCopy:
    """A shard as held by a peer: manifest (with CRCs), pickled objects and tensor bytes."""

    manifest: ShardManifest
    objects: bytes
    data: bytearray

    def verify(self) -> None:
        """Raise ValueError unless the bytes match the manifest's sizes and checksums."""
        m = self.manifest
        if m.objects_crc32 is None or any(t.crc32 is None for t in m.tensors):
            raise ValueError("peer copy: the manifest lacks checksums")
        if len(self.objects) != m.objects_len or len(self.data) != m.data_len:
            raise ValueError(
                f"peer copy: {len(self.objects)} object and {len(self.data)} data bytes for a "
                f"manifest of {m.objects_len} and {m.data_len}"
            )
        algorithm = m.checksum
        if checksum.update(self.objects, algorithm=algorithm) != m.objects_crc32:
            raise ValueError("peer copy: objects checksum mismatch")
        view = memoryview(self.data)
        for t in m.tensors:
            if checksum.update(view[t.begin : t.end], algorithm=algorithm) != t.crc32:
                raise ValueError(f"peer copy: checksum mismatch in tensor {t.name!r}")


def _owner(value: Any) -> str:
    if not isinstance(value, str) or not _OWNER.fullmatch(value):
        raise ValueError(f"an owner is 1 to 128 letters, digits, '_', '.' or '-', got {value!r:.140}")
    return value


def _manifest(header: dict[str, Any]) -> ShardManifest:
    """The manifest a header carries, as JSON text."""
    text = header.get("manifest")
    if not isinstance(text, str):
        raise ValueError(f"the header's manifest is not JSON text: {type(text).__name__}")
    return ShardManifest.from_json(text)


def _sizes(header: dict[str, Any], manifest: ShardManifest, max_data: int) -> tuple[int, int]:
    """The announced byte counts, which must be the manifest's and within the bounds."""
    objects_len, data_len = header.get("objects_len"), header.get("data_len")
    if objects_len != manifest.objects_len or data_len != manifest.data_len:
        raise ValueError(
            f"announced {objects_len!r} object and {data_len!r} data bytes for a manifest of "
            f"{manifest.objects_len} and {manifest.data_len}"
        )
    if manifest.objects_len > MAX_OBJECTS or manifest.data_len > max_data:
        raise ValueError(
            f"a copy of {manifest.objects_len} object and {manifest.data_len} data bytes is over "
            f"the bounds ({MAX_OBJECTS} and {max_data})"
        )
    return manifest.objects_len, manifest.data_len


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(_TIMEOUT_S)
        try:
            session = server_handshake(sock, self.server.secret, PURPOSE, ticket=self.server.take_ticket(sock))
        except (AuthError, OSError):
            self.server.refused += 1
            return
        try:
            header = json.loads(recv_sealed(sock, session, MAX_HEADER))
            if not isinstance(header, dict):
                raise ValueError("a request is a JSON object")
            if header.get("op") == "put":
                error = self._put(sock, session, header)
                send_sealed(sock, session, json.dumps({"ok": error is None, "error": error}).encode())
            elif header.get("op") == "get":
                owner = _owner(header.get("owner"))
                with self.server.lock:
                    copy = self.server.copies.get(owner)
                if copy is None:
                    send_sealed(sock, session, json.dumps({"ok": False}).encode())
                else:
                    send_sealed(
                        sock,
                        session,
                        json.dumps(
                            {
                                "ok": True,
                                "manifest": copy.manifest.to_json(),
                                "objects_len": len(copy.objects),
                                "data_len": len(copy.data),
                            }
                        ).encode(),
                    )
                    sock.sendall(copy.objects)
                    sock.sendall(copy.data)
            else:
                raise ValueError(f"unknown operation {header.get('op')!r}")
        except (OSError, ValueError, KeyError, TypeError):  # AuthError and FrameError included
            return  # a broken client cannot hurt the copies already held

    def _put(self, sock: socket.socket, session: Session, header: dict[str, Any]) -> str | None:
        """Receives and checks a copy; None when it is now held, else why it was refused.

        The header is answered first ("send" or why not), so a refused push never sends its
        bytes, and learns the reason rather than a broken pipe.
        """
        server = self.server
        try:
            owner = _owner(header.get("owner"))
            manifest = _manifest(header)
            objects_len, data_len = _sizes(header, manifest, server.max_bytes)
        except (ValueError, TypeError) as e:
            return f"refused: {e}"
        size = objects_len + data_len
        with server.lock:
            if owner not in server.copies and len(server.copies) >= MAX_OWNERS:
                return f"refused: this peer store already holds {MAX_OWNERS} owners"
            if server.held + server.arriving + size > server.max_bytes:
                return (
                    f"refused: a {size}-byte copy would take this peer store over its {server.max_bytes} "
                    f"bytes ({server.held} held, {server.arriving} arriving)"
                )
            server.arriving += size
        try:
            send_sealed(sock, session, json.dumps({"ok": True, "send": True}).encode())
            copy = PeerCopy(manifest, bytes(recv_exact(sock, objects_len)), recv_exact(sock, data_len))
            try:
                copy.verify()
            except ValueError as e:
                return f"refused: {e}"
            with server.lock:
                old = server.copies.get(owner)
                server.copies[owner] = copy  # the newest push wins (see the module doc)
                server.held += size - (len(old.objects) + len(old.data) if old is not None else 0)
            return None
        finally:
            with server.lock:
                server.arriving -= size


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the kernel's accept queue: socketserver's 5 drops a key holder's SYN in a flood

    def __init__(self, address: tuple[str, int], secret: JobSecret, max_bytes: int) -> None:
        super().__init__(address, _Handler)
        self.secret = secret
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.copies: dict[str, PeerCopy] = {}
        self.held = 0
        self.arriving = 0
        self.refused = 0
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        self._tickets: dict[socket.socket, bytes] = {}
        self.gate: Gate | None = None

    def admitted(self, conn: socket.socket, ticket: bytes) -> None:
        """A key holder's connection, from the gate: served on a thread of its own, within the bound."""
        if not self._slots.acquire(blocking=False):
            conn.close()  # as many transfers as the node's shards need already
            return
        try:
            with self.lock:
                self._tickets[conn] = ticket
            super().process_request(conn, conn.getpeername())
        except BaseException:
            with self.lock:
                self._tickets.pop(conn, None)
            conn.close()
            self._slots.release()
            raise

    def take_ticket(self, conn: socket.socket) -> bytes | None:
        with self.lock:
            return self._tickets.pop(conn, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class PeerStore:
    """Holds the newest snapshot per owner in memory and serves it back to key holders.

    Args:
        secret: the job's secret; clients must hold it, and so does this store.
        max_bytes: the most memory all copies (held and arriving) may take.
    """

    def __init__(
        self, secret: JobSecret, host: str = "127.0.0.1", port: int = 0, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError(f"PeerStore needs the job's JobSecret, got {type(secret).__name__}")
        self._server = _Server((host, port), secret, max_bytes)
        self._stopped = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def refused(self) -> int:
        """Connections that failed authentication."""
        return self._server.refused + (self._server.gate.refused if self._server.gate else 0)

    def start(self) -> PeerStore:
        """Serve in background threads (for a replica embedding the store)."""
        if self._server.gate is None:
            self._server.gate = Gate(
                self._server.socket, self._server.secret, PURPOSE, self._server.admitted, name="unbroken-peer-store"
            )
        return self

    def serve_forever(self) -> None:
        """Serves until :meth:`close` (from another thread) or an interrupt."""
        self.start()
        self._stopped.wait()

    def owners(self) -> dict[str, int]:
        with self._server.lock:
            return {k: v.manifest.step for k, v in self._server.copies.items()}

    def close(self) -> None:
        self._stopped.set()
        if self._server.gate is not None:
            self._server.gate.close()  # closes the listening socket too
        self._server.server_close()


class PeerClient:
    """Pushes a shard to a peer store and fetches it back, authenticated with ``secret``."""

    def __init__(self, host: str, port: int, secret: JobSecret, timeout: float = _TIMEOUT_S) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError(f"PeerClient needs the job's JobSecret, got {type(secret).__name__}")
        self.address = (host, int(port))
        self.timeout = timeout
        self._secret = secret

    def _connect(self) -> tuple[socket.socket, Session]:
        sock = socket.create_connection(self.address, timeout=self.timeout)
        try:
            return sock, client_handshake(sock, self._secret, PURPOSE)
        except BaseException:
            sock.close()
            raise

    def put(self, owner: str, manifest: ShardManifest, objects: bytes, data: memoryview) -> None:
        """Pushes a copy; PeerError (a ConnectionError) with the store's reason if it is refused."""
        sock, session = self._connect()
        with sock:
            send_sealed(
                sock,
                session,
                json.dumps(
                    {
                        "op": "put",
                        "owner": owner,
                        "manifest": manifest.to_json(),
                        "objects_len": len(objects),
                        "data_len": len(data),
                    }
                ).encode(),
            )
            answer = json.loads(recv_sealed(sock, session, MAX_HEADER))
            if isinstance(answer, dict) and answer.get("send") is True:
                sock.sendall(objects)
                sock.sendall(data)
                answer = json.loads(recv_sealed(sock, session, MAX_HEADER))
        if not isinstance(answer, dict) or answer.get("ok") is not True:
            reason = answer.get("error") if isinstance(answer, dict) else answer
            raise PeerError(f"the peer store at {self.address[0]}:{self.address[1]} {reason or 'refused the copy'}")

    def get(self, owner: str, max_bytes: int = DEFAULT_MAX_BYTES) -> PeerCopy | None:
        """The peer's newest copy for ``owner`` (unverified: call :meth:`PeerCopy.verify`), or
        None if it holds none."""
        sock, session = self._connect()
        with sock:
            send_sealed(sock, session, json.dumps({"op": "get", "owner": owner}).encode())
            header = json.loads(recv_sealed(sock, session, MAX_HEADER))
            if not isinstance(header, dict) or not header.get("ok"):
                return None
            try:
                manifest = _manifest(header)
                objects_len, data_len = _sizes(header, manifest, max_bytes)
            except (ValueError, TypeError) as e:
                raise PeerError(f"the peer store at {self.address[0]}:{self.address[1]} sent a bad copy: {e}") from e
            objects = bytes(recv_exact(sock, objects_len))
            data = recv_exact(sock, data_len)
        return PeerCopy(manifest, objects, data)


def serve(secret: JobSecret, port: int = 0, max_bytes: int = DEFAULT_MAX_BYTES, host: str = "127.0.0.1") -> None:
    """Runs a store on ``host`` (loopback unless told), prints its port, serves until interrupted."""
    store = PeerStore(secret, host=host, port=port, max_bytes=max_bytes)
    print(store.address[1], flush=True)
    try:
        store.serve_forever()
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> None:
    """``python -m unbroken.checkpoint.peer [PORT]``: the job's secret comes from the file
    named by ``UNBROKEN_SECRET_FILE``."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    serve(JobSecret.required(), port=int(args[0]) if args else 0)


if __name__ == "__main__":
    main()
