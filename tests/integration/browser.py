"""Headless Chromium driven over the DevTools protocol, with no client library.

Debian's ``chromium`` package is all it needs: a few dozen lines of WebSocket (RFC 6455) here
spare the suite a browser-automation dependency and its downloads.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1200,1000",
]


class Browser:
    """One headless Chromium showing ``url``; ``evaluate`` runs JavaScript in the page."""

    def __init__(self, url: str, profile: Path, timeout: float = 20.0) -> None:
        assert CHROMIUM is not None
        profile.mkdir(parents=True, exist_ok=True)
        self.log = open(profile.parent / "chromium.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", url],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            port = self._debug_port(profile, timeout)
            pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5))
            ws = next(p["webSocketDebuggerUrl"] for p in pages if p.get("type") == "page")
            self.sock = _ws_connect(ws, timeout)
        except BaseException:
            self.close()
            raise
        self._id = 0

    def _debug_port(self, profile: Path, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        path = profile / "DevToolsActivePort"
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.proc.returncode}")
            time.sleep(0.1)
        raise TimeoutError("chromium opened no DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        _ws_send(self.sock, json.dumps({"id": self._id, "method": method, "params": params}).encode())
        while True:
            msg = json.loads(_ws_recv(self.sock))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        if getattr(self, "sock", None) is not None:
            self.sock.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def _ws_connect(url: str, timeout: float) -> socket.socket:
    assert url.startswith("ws://")
    hostport, _, path = url[len("ws://") :].partition("/")
    host, _, port = hostport.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("DevTools closed the WebSocket handshake")
        head += chunk
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise ConnectionError(f"DevTools refused the WebSocket: {head[:200]!r}")
    return sock


def _ws_send(sock: socket.socket, payload: bytes) -> None:
    mask = os.urandom(4)
    n = len(payload)
    header = bytes([0x81]) + (
        bytes([0x80 | n])
        if n < 126
        else bytes([0x80 | 126]) + n.to_bytes(2, "big")
        if n < 1 << 16
        else bytes([0x80 | 127]) + n.to_bytes(8, "big")
    )
    sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("DevTools closed the WebSocket")
        buf += chunk
    return bytes(buf)


def _ws_recv(sock: socket.socket) -> bytes:
    """One message (its fragments joined); control frames are skipped."""
    message = b""
    while True:
        b0, b1 = _recv_exact(sock, 2)
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(_recv_exact(sock, 2), "big")
        elif n == 127:
            n = int.from_bytes(_recv_exact(sock, 8), "big")
        payload = _recv_exact(sock, n)
        opcode = b0 & 0x0F
        if opcode in (0x1, 0x2, 0x0):
            message += payload
            if b0 & 0x80:
                return message
        elif opcode == 0x8:
            raise ConnectionError("DevTools closed the WebSocket")
