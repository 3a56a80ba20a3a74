"""``--http-port``: ``/metrics`` for Prometheus and a live dashboard at ``/``, on one port.

The stack is the standard library's threading HTTP server plus ``prometheus_client``'s text
exposition: no web framework to install, and the server runs in threads of its own, so a
scrape or a browser never waits on (or delays) the coordinator's event loop, which it touches
only to ask for ``status()`` (one call scheduled onto the loop per request). The dashboard
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
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from unbroken.observe.live import JobView
from unbroken.observe.prom import registry_for

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 2.0
STATIC = {"/": ("dashboard.html", "text/html; charset=utf-8"), "/dashboard.js": ("dashboard.js", "text/javascript")}
Status = Callable[[], Mapping[str, Any] | None]


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
            self._httpd = _Server((host, port), _handler(self))
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {host}:{port}: {e.strerror}; pick another --http-port (0 picks a free one)"
            ) from e
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    @property
    def url(self) -> str:
        """The dashboard's URL with its token (the link to open)."""
        host, port = self._httpd.server_address[:2]
        host = f"[{host!s}]" if ":" in str(host) else str(host)
        return f"http://{host}:{port}/?token={self.token}"

    def start(self) -> ObserveServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="unbroken-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(5.0)
            self._thread = None
        self._httpd.server_close()

    def authorized(self, authorization: str, query: Mapping[str, list[str]]) -> bool:
        given = authorization
        token = given[len("Bearer ") :] if given.startswith("Bearer ") else (query.get("token") or [""])[0]
        return hmac.compare_digest(token.encode(), self.token.encode())

    def state_json(self) -> bytes:
        self.view.refresh()
        state = self.view.state(self.status())
        state["title"] = self.title
        return json.dumps(state, default=str).encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a browser's open keep-alive connection never holds up close()
    allow_reuse_address = True


def _handler(server: ObserveServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 10.0  # a client that opens a connection and says nothing is dropped
        server_version = "unbroken"

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
