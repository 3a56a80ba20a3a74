"""The client of the job's authenticated store: a ``torch.distributed.Store`` for Gloo and NCCL.

torch accepts Python subclasses of ``dist.Store`` wherever it takes a store (``PrefixStore``,
``ProcessGroupGloo``, ``ProcessGroupNCCL``): their rendezvous call ``set``/``get``/``wait`` (and
``append``, ``multi_get``... which torch builds on ``compare_set``/``get``/``set``). Each call
is one authenticated request to :class:`unbroken.wire.store.StoreServer`.

Blocking calls (``get``, ``wait``) hold a connection for as long as they wait, and the group of
an abandoned epoch may still be waiting in its rendezvous while the next epoch's builds: so
every call takes a connection of its own from a small pool, and a waiting call never delays
another.
"""

from __future__ import annotations

import base64
import datetime
import json
import socket
import threading
from typing import Any

import torch.distributed as dist

from unbroken.config import parse_host_port
from unbroken.wire.auth import AuthError, JobSecret, Session, client_handshake
from unbroken.wire.framing import FrameError, recv_sealed, send_sealed
from unbroken.wire.store import MAX_REQUEST, PURPOSE

MAX_IDLE = 4  # pooled connections kept open between calls


class StoreError(RuntimeError):
    """The store refused a request, or could not be reached or authenticated."""


class AuthenticatedStore(dist.Store):
    """The job's store at ``address`` (``HOST:PORT``), authenticated with ``secret``."""

    def __init__(
        self,
        address: str,
        secret: JobSecret,
        timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        connect_timeout_s: float = 30.0,
    ) -> None:
        super().__init__()
        if not isinstance(secret, JobSecret):
            raise TypeError(f"AuthenticatedStore needs the job's JobSecret, got {type(secret).__name__}")
        self.host, self.port = parse_host_port(address, "store address")
        self._secret = secret
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[tuple[socket.socket, Session]] = []
        self._lock = threading.Lock()
        self._closed = False  # closed: a connection given back is closed, not kept
        self.set_timeout(timeout)

    # -- dist.Store ---------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._call({"op": "set", "key": key, "value": _b64(value)})

    def get(self, key: str) -> bytes:
        answer = self._call({"op": "get", "key": key, "timeout_s": self._timeout_s()})
        if answer.get("timeout"):
            raise StoreError(f"the key {key!r} did not appear in the store within {self._timeout_s():.1f}s")
        return base64.b64decode(answer["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call({"op": "add", "key": key, "amount": int(amount)})["value"])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        answer = self._call({"op": "compare_set", "key": key, "expected": _b64(expected), "desired": _b64(desired)})
        return base64.b64decode(answer["value"])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout_s() if timeout is None else timeout.total_seconds()
        if self._call({"op": "wait", "keys": list(keys), "timeout_s": seconds}).get("timeout"):
            raise StoreError(f"the keys {list(keys)!r} did not all appear in the store within {seconds:.1f}s")

    def check(self, keys: list[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)})["value"])

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete_key", "key": key})["value"])

    def num_keys(self) -> int:
        return int(self._call({"op": "num_keys"})["value"])

    # torch's trampoline looks these two up by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def close(self) -> None:
        """Closes the idle connections; a call still running keeps its own until it ends (and the
        store stays usable: a later call connects again)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    # -- the connection pool ------------------------------------------------------------------

    def _timeout_s(self) -> float:
        return self.timeout.total_seconds()  # type: ignore[attr-defined]  # torch's stub lacks Store.timeout

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        sock, session = self._take()
        try:
            # The server answers a wait at its timeout; a store that stops answering is dead.
            sock.settimeout(float(request.get("timeout_s", 0.0)) + 30.0)
            send_sealed(sock, session, json.dumps(request).encode())
            answer = json.loads(recv_sealed(sock, session, MAX_REQUEST))
        except (OSError, ValueError) as e:  # AuthError and FrameError included
            sock.close()
            raise StoreError(f"the store at {self.host}:{self.port} failed a {request['op']}: {e}") from e
        self._give_back(sock, session)
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else answer
            raise StoreError(f"the store refused a {request['op']}: {error}")
        return answer

    def _take(self) -> tuple[socket.socket, Session]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
        except OSError as e:
            raise StoreError(f"cannot reach the job's store at {self.host}:{self.port}: {e}") from e
        try:
            session = client_handshake(sock, self._secret, PURPOSE)
        except (AuthError, FrameError, OSError) as e:
            sock.close()
            raise StoreError(f"the job's store at {self.host}:{self.port} failed authentication: {e}") from e
        return sock, session

    def _give_back(self, sock: socket.socket, session: Session) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE and not self._closed:
                self._idle.append((sock, session))
                return
        sock.close()


def _b64(value: Any) -> str:
    if isinstance(value, str):
        value = value.encode()
    return base64.b64encode(bytes(value)).decode()
