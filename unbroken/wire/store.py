"""The job's key-value store, on which the cross-replica groups of every epoch rendezvous.

It replaces ``torch.distributed.TCPStore``, which listens on every interface whatever host it is
given and lets anyone who reaches it read and write the job's rendezvous keys (and so pose as a
member of a group). This one binds only the host it is given (the coordinator's) and serves
only clients that prove they hold the job's secret (:func:`~unbroken.wire.auth.server_handshake`,
purpose ``"store"``); every request and answer is MACed. Sizes are bounded: keys, values, the
number of keys (the oldest are dropped beyond it: each epoch's groups write fresh keys, and the
keys of long-finished epochs are never read again) and connections: authenticated ones, and
apart from them those still authenticating, which a :class:`~unbroken.wire.gate.Gate` holds
without a thread (a stranger's flood cannot take a key holder's slot). The client side, a
``torch.distributed.Store`` that Gloo rendezvous through, is
:class:`unbroken.comm.store_client.AuthenticatedStore`.

Protocol, after the handshake: each request is one sealed frame holding a JSON object
(``op``, ``key``/``keys``, base64 ``value``...), answered by one sealed frame
(``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``). Waits (``get``, ``wait``) block on
the server, bounded by the timeout the client sends (at most :data:`MAX_WAIT_S`). Threat model
as for :mod:`unbroken.wire.auth`. This module imports no torch: the coordinator hosts it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from unbroken.wire.admission import DEFAULT_POLICY, AdmissionPolicy, RefusalLog
from unbroken.wire.auth import AuthError, JobSecret, server_handshake
from unbroken.wire.framing import FrameError, recv_sealed, send_sealed
from unbroken.wire.gate import Gate

log = logging.getLogger(__name__)

PURPOSE = "store"
MAX_KEY = 1024
MAX_VALUE = 1 << 20
MAX_KEYS = 1 << 18
MAX_TOTAL_BYTES = 256 << 20
MAX_WAIT_S = 3600.0
MAX_CONNECTIONS = 4096  # authenticated: every rank of every replica keeps one or two open
MAX_REQUEST = 4 * MAX_VALUE  # base64 of a value, keys and JSON around them


class StoreRequestError(ValueError):
    """A request the store refuses (malformed, over a bound); answered, the connection stays."""


class StoreServer:
    """Serves the job's keys to clients holding its secret, from background threads.

    Args:
        host: the interface to bind (the coordinator's host: a loopback coordinator gives a
            loopback store).
        secret: the job's secret.
        port: 0 picks a free port.
        admission: the budget of connections that have not authenticated (a
            :class:`~unbroken.wire.gate.Gate` holds them; strangers never reach a thread).
    """

    def __init__(
        self, host: str, secret: JobSecret, port: int = 0, admission: AdmissionPolicy = DEFAULT_POLICY
    ) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError(f"StoreServer needs the job's JobSecret, got {type(secret).__name__}")
        self._secret = secret
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._cond = threading.Condition()
        self._sock = socket.create_server((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._refusals = RefusalLog(log, "refused store connections")
        self._refused = 0
        self.dropped_keys = 0
        self.served = 0  # requests answered (a node agent's store: the rendezvous it hosted)
        self.gate = Gate(self._sock, secret, PURPOSE, self._admitted, name="unbroken-store", policy=admission)

    @property
    def refused(self) -> int:
        """Connections refused: a wrong ticket or proof, or over the bound of authenticated ones."""
        return self._refused + self.gate.refused

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.gate.close()
        with self._conns_lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def _admitted(self, conn: socket.socket, ticket: bytes) -> None:
        """A key holder's connection, from the gate: a thread of its own, within the bound."""
        with self._conns_lock:
            full = len(self._conns) >= MAX_CONNECTIONS
            if not full:
                self._conns.add(conn)
        if full:
            conn.close()
            self._refused += 1
            self._refusals.note(f"over {MAX_CONNECTIONS} authenticated connections", time.monotonic())
            return
        try:
            threading.Thread(target=self._serve, args=(conn, ticket), name="unbroken-store-conn", daemon=True).start()
        except BaseException:
            with self._conns_lock:
                self._conns.discard(conn)
            raise

    def _serve(self, conn: socket.socket, ticket: bytes) -> None:
        try:
            with conn:
                try:
                    session = server_handshake(conn, self._secret, PURPOSE, ticket=ticket)
                except (AuthError, OSError) as e:
                    self._refused += 1
                    self._refusals.note(str(e), time.monotonic())
                    return
                # Authenticated clients keep their connection between epochs: no idle timeout.
                conn.settimeout(None)
                while not self._closed:
                    try:
                        request = recv_sealed(conn, session, MAX_REQUEST)
                    except (FrameError, OSError):
                        return  # the client went away
                    except AuthError as e:
                        log.warning("dropped a store connection: %s", e)
                        return
                    self.served += 1
                    try:
                        answer = {"ok": True, **self._handle(json.loads(request))}
                    except (StoreRequestError, ValueError, KeyError, TypeError) as e:
                        answer = {"ok": False, "error": str(e)}
                    send_sealed(conn, session, json.dumps(answer).encode())
        except OSError:
            return
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    # -- the operations (also called directly by tests) -------------------------------------

    def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(req, dict):
            raise StoreRequestError("a store request is a JSON object")
        op = req.get("op")
        if op == "set":
            self._set(_key(req.get("key")), _value(req.get("value")))
            return {}
        if op == "get":
            key = _key(req.get("key"))
            with self._cond:
                if (
                    not self._cond.wait_for(lambda: key in self._data or self._closed, _timeout(req))
                    or key not in self._data
                ):
                    return {"timeout": True}
                return {"value": base64.b64encode(self._data[key]).decode()}
        if op == "add":
            key, amount = _key(req.get("key")), req.get("amount")
            if type(amount) is not int or abs(amount) > 1 << 62:
                raise StoreRequestError(f"add needs an integer amount, got {amount!r}")
            with self._cond:
                try:
                    value = int(self._data.get(key, b"0")) + amount
                except ValueError:
                    raise StoreRequestError(f"the value of {key!r} is not an integer") from None
                self._set_locked(key, str(value).encode())
            return {"value": value}
        if op == "compare_set":
            key, expected, desired = _key(req.get("key")), _value(req.get("expected")), _value(req.get("desired"))
            with self._cond:  # TCPStore's semantics, which torch's append builds on
                current = self._data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self._set_locked(key, desired)
                    current = desired
                elif current is None:
                    current = expected
            return {"value": base64.b64encode(current).decode()}
        if op == "wait":
            keys = _keys(req.get("keys"))
            with self._cond:
                ok = self._cond.wait_for(lambda: all(k in self._data for k in keys) or self._closed, _timeout(req))
                return {"timeout": not (ok and all(k in self._data for k in keys))}
        if op == "check":
            keys = _keys(req.get("keys"))
            with self._cond:
                return {"value": all(k in self._data for k in keys)}
        if op == "delete_key":
            key = _key(req.get("key"))
            with self._cond:
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(key) + len(old)
            return {"value": old is not None}
        if op == "num_keys":
            with self._cond:
                return {"value": len(self._data)}
        raise StoreRequestError(f"unknown store operation {op!r}")

    def _set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._set_locked(key, value)

    def _set_locked(self, key: str, value: bytes) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self._bytes -= len(key) + len(old)
        self._data[key] = value
        self._bytes += len(key) + len(value)
        while len(self._data) > MAX_KEYS or self._bytes > MAX_TOTAL_BYTES:
            k, v = self._data.popitem(last=False)  # the oldest: an epoch long finished
            self._bytes -= len(k) + len(v)
            self.dropped_keys += 1
        self._cond.notify_all()


def _key(key: Any) -> str:
    if not isinstance(key, str) or not 0 < len(key.encode()) <= MAX_KEY:
        raise StoreRequestError(f"a store key is a string of 1 to {MAX_KEY} bytes")
    return key


def _keys(keys: Any) -> list[str]:
    if not isinstance(keys, list) or len(keys) > 1024:
        raise StoreRequestError("keys are a list of at most 1024 strings")
    return [_key(k) for k in keys]


def _value(value: Any) -> bytes:
    raw = base64.b64decode(value, validate=True) if isinstance(value, str) and len(value) <= MAX_REQUEST else None
    if raw is None or len(raw) > MAX_VALUE:
        raise StoreRequestError(f"a store value is base64 of at most {MAX_VALUE} bytes")
    return raw


def _timeout(req: dict[str, Any]) -> float:
    t = req.get("timeout_s")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise StoreRequestError(f"timeout_s must be a finite number >= 0, got {t!r}")
    return min(float(t), MAX_WAIT_S)
