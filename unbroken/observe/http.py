"""``--http-port``: ``/metrics`` for Prometheus and a live dashboard at ``/``, on one port.

The stack is the standard library's HTTP request handler plus ``prometheus_client``'s text
exposition: no web framework to install, and the server runs in threads of its own, so a
scrape or a browser never waits on (or delays) the coordinator's event loop, which it touches
only to ask for ``status()`` (one call scheduled onto the loop per request). Those threads are
a fixed pool (:data:`WORKERS`): a request reaches one only once its head has arrived whole,
read by a :class:`~unbroken.wire.gate.Gate` without a thread, within a budget of open
connections (the newest first) and a deadline; so idle or dripping connections hold no
thread, and a flood of them cannot lock out a scrape. The dashboard
polls ``/api/state`` once a second rather than holding a server-sent-event stream open: a
poll is stateless (a restarted coordinator or a sleeping laptop needs no reconnect logic) and
holds no thread per open tab; a second's latency is well under the span of a replica's state.

Security: the server binds the coordinator's host (loopback unless told otherwise), and every
data endpoint (``/metrics``, ``/api/state``) demands the job's read-only token: an HMAC of the
job's secret (:func:`read_token`), given as ``Authorization: Bearer TOKEN`` (Prometheus'
``authorization`` setting) or ``?token=TOKEN`` (the dashboard URL that ``unbroken run``
prints). The token grants reading only: nothing served can change the job, and the token does
not let anyone derive the secret. The page and its script are static and carry no data.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from unbroken.observe.live import JobView
from unbroken.observe.prom import registry_for
from unbroken.wire.admission import AdmissionPolicy, RefusalLog
from unbroken.wire.gate import FirstBytes, Gate

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 2.0
STATIC = {"/": ("dashboard.html", "text/html; charset=utf-8"), "/dashboard.js": ("dashboard.js", "text/javascript")}
Status = Callable[[], Mapping[str, Any] | None]
WORKERS = 4  # threads serving requests whose head has arrived; the server never has more
MAX_QUEUED = 64  # complete requests waiting for a worker; more are closed (and logged)
MAX_HEAD = 16 << 10  # a request line and headers; a dashboard's or Prometheus' take < 1 KiB
REQUEST_DEADLINE_S = 10.0  # from the connection's accept to its whole head
ADMISSION = AdmissionPolicy(max_pending=64, max_pending_per_source=64, deadline_s=REQUEST_DEADLINE_S)


class _Head(FirstBytes):
    """A request's line and headers, whole (a GET has no body)."""

    refusal = b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n\r\n"

    def more(self, buf: bytes) -> int:
        if b"\r\n\r\n" in buf or b"\n\n" in buf:
            return 0
        if len(buf) >= MAX_HEAD:
            raise ValueError(f"a request head over {MAX_HEAD} bytes")
        return MAX_HEAD - len(buf)

    def check(self, buf: bytes) -> None:
        if self.more(buf) != 0:
            raise ValueError(f"a request head over {MAX_HEAD} bytes")


def read_token(key: bytes) -> str:
    """The dashboard's and the scraper's read-only token: derived from the job's secret key, so
    every process of the job serves the same one, and holding it reveals nothing of the key."""
    return hmac.new(key, b"unbroken/observe read-only token v1", hashlib.sha256).hexdigest()[:32]


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Mapping[str, Any] | None]) -> Status:
    """``fn`` (which reads state the event loop owns) made callable from the server's threads:
    it runs on ``loop``; an answer that does not come in time is None (the page says so)."""

    async def call() -> Mapping[str, Any] | None:
        return fn()

    def status() -> Mapping[str, Any] | None:
        if loop.is_closed():
            return None
        future = asyncio.run_coroutine_threadsafe(call(), loop)
        try:
            return future.result(STATUS_TIMEOUT_S)
        except Exception:
            future.cancel()
            return None

    return status


class ObserveServer:
    """Serves one job's view. ``start()``, then ``url``; ``close()``.

    Args:
        host: the address to bind (the coordinator's: loopback unless the job spans machines).
        port: 0 picks a free one.
        view: the job's events and rows.
        status: the coordinator's live status (see :func:`on_loop`); None for an agent.
        token: the read-only token (:func:`read_token`).
        title: what the page calls the job.
    """

    def __init__(
        self, host: str, port: int, view: JobView, status: Status | None, token: str, title: str = "unbroken"
    ) -> None:
        self.view, self.token, self.title = view, token, title
        self.status: Status = status or (lambda: None)
        self.registry = registry_for(view, self.status)
        try:
            self._sock = socket.create_server((host, port))
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {host}:{port}: {e.strerror}; pick another --http-port (0 picks a free one)"
            ) from e
        self._handler = _handler(self)
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="unbroken-http")
        self._lock = threading.Lock()
        self._queued = 0
        self._refusals = RefusalLog(log, "refused HTTP requests")
        self.gate: Gate | None = None

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host!s}:{port}"

    @property
    def url(self) -> str:
        """The dashboard's URL with its token (the link to open)."""
        host, port = self._sock.getsockname()[:2]
        host = f"[{host!s}]" if ":" in str(host) else str(host)
        return f"http://{host}:{port}/?token={self.token}"

    def start(self) -> ObserveServer:
        if self.gate is None:
            self.gate = Gate(
                self._sock, None, "http", self._admitted, name="unbroken-http", policy=ADMISSION, first=_Head()
            )
        return self

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()  # closes the listening socket
            self.gate = None
        else:
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _admitted(self, conn: socket.socket, head: bytes) -> None:
        with self._lock:
            full = self._queued >= MAX_QUEUED
            if not full:
                self._queued += 1
        if full:
            conn.close()
            self._refusals.note(f"over {MAX_QUEUED} requests waiting for a worker", time.monotonic())
            return
        try:
            self._pool.submit(self._work, conn, head)
        except RuntimeError:  # the pool is shut down: the server is closing
            conn.close()
            with self._lock:
                self._queued -= 1

    def _work(self, conn: socket.socket, head: bytes) -> None:
        try:
            with conn:
                conn.settimeout(REQUEST_DEADLINE_S)  # a reader that stops reading the answer
                self._handler((conn, head), conn.getpeername(), None)  # type: ignore[arg-type]  # no socketserver
        except Exception as e:  # the client went away: nothing to answer
            log.debug("an HTTP request ended early: %s", e)
        finally:
            with self._lock:
                self._queued -= 1

    def authorized(self, authorization: str, query: Mapping[str, list[str]]) -> bool:
        given = authorization
        token = given[len("Bearer ") :] if given.startswith("Bearer ") else (query.get("token") or [""])[0]
        return hmac.compare_digest(token.encode(), self.token.encode())

    def state_json(self) -> bytes:
        self.view.refresh()
        state = self.view.state(self.status())
        state["title"] = self.title
        return json.dumps(state, default=str).encode()


def _handler(server: ObserveServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "unbroken"

        def setup(self) -> None:
            # The gate read the request's head already; the answer goes to the socket.
            self.connection, head = self.request
            self.rfile = io.BytesIO(head)
            self.wfile = self.connection.makefile("wb")

        def finish(self) -> None:
            try:
                self.wfile.flush()
            except OSError:
                pass
            self.wfile.close()
            self.rfile.close()

        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            if url.path in STATIC:
                name, content_type = STATIC[url.path]
                self._send(200, content_type, (resources.files("unbroken.observe") / "static" / name).read_bytes())
            elif url.path == "/healthz":
                self._send(200, "text/plain", b"ok\n")
            elif url.path not in ("/metrics", "/api/state"):
                self._send(404, "text/plain", b"not found: / (dashboard), /metrics, /api/state, /healthz\n")
            elif not server.authorized(self.headers.get("Authorization", ""), query):
                self._send(
                    401,
                    "text/plain",
                    b"the job's read-only token is needed: Authorization: Bearer TOKEN, or ?token=TOKEN "
                    b"(unbroken run prints the dashboard's URL with it)\n",
                )
            else:
                try:
                    if url.path == "/metrics":
                        self._send(200, CONTENT_TYPE_LATEST, generate_latest(server.registry))
                    else:
                        self._send(200, "application/json", server.state_json())
                except Exception:
                    log.exception("serving %s failed", url.path)
                    self._send(500, "text/plain", b"internal error (see the job's log)\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the http.server API)
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


async def serve_async(
    host: str, port: int, view: JobView, status_fn: Callable[[], Mapping[str, Any] | None] | None, token: str
) -> ObserveServer:
    """Starts a server from inside the event loop that owns ``status_fn``'s state."""
    loop = asyncio.get_running_loop()
    status = on_loop(loop, status_fn) if status_fn is not None else None
    return ObserveServer(host, port, view, status, token).start()
