"""The attacker and the legitimate client of ``unbroken bench abuse``, in a process of their own.

``python -m unbroken.bench.control_plane.abuse_flood SPEC.json`` floods every listener named in the spec with
connections that never authenticate (idle ones, and ones dripping a byte a second), reopens
those the listener closes, fuzzes each with a few wrong tickets and garbage, and meanwhile
connects to each listener as a key holder would (a full handshake, or an HTTP GET), counting
the connects that fail. It runs until SIGTERM or its time is up, then prints one JSON object.
Everything is bounded: the sockets held per listener, the time, the records kept.

A process apart from the job, as a real attacker is: its Python threads do not share the
coordinator's interpreter lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import selectors
import signal
import socket
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.checkpoint.peer import PeerClient
from unbroken.wire.auth import TICKET_BYTES, TICKET_MAGIC, JobSecret, client_handshake

ROUND_S = 0.1
MAX_ERRORS = 5
MAX_SAMPLES = 10_000


@dataclass
class Target:
    name: str
    host: str
    port: int
    kind: str  # "ticket" (purpose below), "peer", or "http"
    purpose: str = ""
    idle: list[socket.socket] = field(default_factory=list)
    drip: list[socket.socket] = field(default_factory=list)
    opened: int = 0
    closed_by_server: int = 0
    connect_failed: int = 0
    held_max: int = 0
    fuzzed: int = 0
    legit_ok: int = 0
    legit_refused: int = 0
    legit_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def held(self) -> int:
        return len(self.idle) + len(self.drip)

    def figures(self) -> dict[str, Any]:
        return {
            "held_max": self.held_max,
            "held_end": self.held(),
            "opened": self.opened,
            "closed_by_listener": self.closed_by_server,
            "connect_failed": self.connect_failed,
            "fuzzed": self.fuzzed,
            "legit_ok": self.legit_ok,
            "legit_refused": self.legit_refused,
            "legit_p50_ms": round(statistics.median(self.legit_ms), 2) if self.legit_ms else None,
            "legit_max_ms": round(max(self.legit_ms), 2) if self.legit_ms else None,
            "errors": self.errors,
        }


class Flood:
    """Holds ``idle`` + ``drip`` unauthenticated connections on each target, from one thread."""

    def __init__(self, targets: list[Target], idle: int, drip: int, reopen_per_round: int = 32) -> None:
        self.targets, self.idle, self.drip, self.reopen = targets, idle, drip, reopen_per_round
        self.stop = threading.Event()
        self._sel = selectors.DefaultSelector()

    def run(self, until: float) -> None:
        last_drip = 0.0
        try:
            while not self.stop.is_set() and time.monotonic() < until:
                for t in self.targets:
                    self._top_up(t)
                    t.held_max = max(t.held_max, t.held())
                now = time.monotonic()
                if now - last_drip >= 1.0:
                    last_drip = now
                    for t in self.targets:
                        for s in list(t.drip):
                            self._send(t, s, b"G" if t.kind == "http" else secrets.token_bytes(1))
                for key, _ in self._sel.select(ROUND_S):
                    self._readable(key.data, key.fileobj)  # type: ignore[arg-type]
        finally:
            for t in self.targets:
                for s in t.idle + t.drip:
                    with contextlib.suppress(OSError):
                        s.close()
                t.idle.clear()
                t.drip.clear()
            self._sel.close()

    def _top_up(self, t: Target) -> None:
        for pool, want in ((t.idle, self.idle), (t.drip, self.drip)):
            for _ in range(min(want - len(pool), self.reopen)):  # a round's burst is bounded too
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                err = s.connect_ex((t.host, t.port))
                if err not in (0, errno.EINPROGRESS):
                    s.close()
                    t.connect_failed += 1
                    break
                pool.append(s)
                t.opened += 1
                self._sel.register(s, selectors.EVENT_READ, t)
        # A few strangers a round that send garbage or a wrong ticket, then hang up (fuzz).
        wrong = (
            secrets.token_bytes(TICKET_BYTES),
            TICKET_MAGIC + secrets.token_bytes(TICKET_BYTES - len(TICKET_MAGIC)),
        )
        for payload in (*wrong, b"GET /" + b"A" * 20000):
            with contextlib.suppress(OSError), socket.create_connection((t.host, t.port), timeout=0.2) as s:
                s.sendall(payload[:TICKET_BYTES] if t.kind != "http" else payload)
                t.fuzzed += 1

    def _send(self, t: Target, s: socket.socket, data: bytes) -> None:
        try:
            s.send(data)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._lost(t, s)

    def _readable(self, t: Target, s: socket.socket) -> None:
        try:
            data = s.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._lost(t, s)

    def _lost(self, t: Target, s: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(s)
        s.close()
        for pool in (t.idle, t.drip):
            if s in pool:
                pool.remove(s)
                t.closed_by_server += 1


def legit_connect(t: Target, secret: JobSecret, token: str) -> None:
    """One connect as the job's own processes make it; raises on failure."""
    if t.kind == "http":
        req = urllib.request.Request(f"http://{t.host}:{t.port}/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=5.0) as resp:
            resp.read()
            if resp.status != 200:
                raise ConnectionError(f"HTTP {resp.status}")
    elif t.kind == "peer":
        PeerClient(t.host, t.port, secret, timeout=5.0).get("abuse-probe")
    else:
        with socket.create_connection((t.host, t.port), timeout=5.0) as s:
            client_handshake(s, secret, t.purpose, timeout_s=5.0)


def probe(targets: list[Target], secret: JobSecret, token: str, every_s: float, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        for t in targets:
            start = time.perf_counter()
            try:
                legit_connect(t, secret, token)
            except Exception as e:  # each failure is the figure this bench exists for
                t.legit_refused += 1
                if len(t.errors) < MAX_ERRORS:
                    t.errors.append(f"{type(e).__name__}: {e}"[:200])
            else:
                t.legit_ok += 1
                if len(t.legit_ms) < MAX_SAMPLES:
                    t.legit_ms.append((time.perf_counter() - start) * 1e3)


def main(argv: list[str] | None = None) -> None:
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    secret = JobSecret.load(spec["secret_file"])
    targets = []
    for t in spec["targets"]:
        host, _, port = t["address"].rpartition(":")
        targets.append(Target(t["name"], host, int(port), t["kind"], t.get("purpose", "")))
    flood = Flood(targets, int(spec["idle"]), int(spec["drip"]), int(spec.get("reopen_per_round", 32)))
    signal.signal(signal.SIGTERM, lambda *_: flood.stop.set())
    prober = threading.Thread(
        target=probe, args=(targets, secret, spec["token"], float(spec["probe_every_s"]), flood.stop), daemon=True
    )
    prober.start()
    print("flooding", file=sys.stderr, flush=True)
    flood.run(time.monotonic() + float(spec["seconds"]))
    flood.stop.set()
    prober.join(30)
    print(json.dumps({"pid": os.getpid(), "targets": {t.name: t.figures() for t in targets}}), flush=True)


if __name__ == "__main__":
    main()
