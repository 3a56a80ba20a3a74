"""The handshake and message MACs that every listener relies on, over real socket pairs."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from unbroken.config import ENV_SECRET_FILE, ConfigError
from unbroken.wire.auth import (
    AuthError,
    JobSecret,
    Session,
    client_handshake,
    client_handshake_async,
    server_handshake,
    server_handshake_async,
)


def _both(server: Callable[[socket.socket], Any], client: Callable[[socket.socket], Any]) -> tuple[Any, Any]:
    """Runs the two sides of a handshake on a connected socket pair; returns results or exceptions."""
    a, b = socket.socketpair()
    results: list[Any] = [None, None]

    def run(i: int, fn: Callable[[socket.socket], Any], sock: socket.socket) -> None:
        try:
            results[i] = fn(sock)
        except Exception as e:  # handed back to the test to assert on
            results[i] = e
        finally:
            sock.close()  # a failed side hangs up, as a listener does

    threads = [threading.Thread(target=run, args=(0, server, a)), threading.Thread(target=run, args=(1, client, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results[0], results[1]


def test_a_shared_secret_authenticates_both_sides_and_their_messages() -> None:
    secret = JobSecret.generate()
    s, c = _both(
        lambda x: server_handshake(x, secret, "coordinator"), lambda x: client_handshake(x, secret, "coordinator")
    )
    assert isinstance(s, Session) and isinstance(c, Session)
    for payload in (b'{"op":"hello"}', b'{"op":"quorum","step":3}'):
        assert s.open_line(c.seal_line(payload)) == payload
        assert c.open_line(s.seal_line(payload)) == payload


def test_a_client_without_the_secret_is_refused_and_learns_nothing() -> None:
    s, c = _both(
        lambda x: server_handshake(x, JobSecret.generate(), "coordinator"),
        lambda x: client_handshake(x, JobSecret.generate(), "coordinator"),
    )
    assert isinstance(s, AuthError)
    assert isinstance(c, AuthError)  # the server hung up instead of proving itself


def test_a_handshake_for_one_listener_does_not_open_another() -> None:
    secret = JobSecret.generate()
    s, c = _both(
        lambda x: server_handshake(x, secret, "transfer"), lambda x: client_handshake(x, secret, "coordinator")
    )
    assert isinstance(s, AuthError) and isinstance(c, AuthError)


def test_a_silent_client_times_out() -> None:
    secret = JobSecret.generate()
    s, _ = _both(
        lambda x: server_handshake(x, secret, "coordinator", timeout_s=0.2), lambda x: (x.recv(100), time.sleep(1.0))
    )
    assert isinstance(s, AuthError) and "did not authenticate" in str(s)


def test_forged_replayed_reordered_and_reflected_messages_fail() -> None:
    secret = JobSecret.generate()
    s, c = _both(
        lambda x: server_handshake(x, secret, "coordinator"), lambda x: client_handshake(x, secret, "coordinator")
    )
    first, second = c.seal_line(b'{"n":1}'), c.seal_line(b'{"n":2}')
    with pytest.raises(AuthError):
        s.open_line(second)  # reordered: sealed as message 1, read as message 0
    s2, c2 = _both(
        lambda x: server_handshake(x, secret, "coordinator"), lambda x: client_handshake(x, secret, "coordinator")
    )
    with pytest.raises(AuthError):
        s2.open_line(first)  # replayed from another connection
    line = c2.seal_line(b'{"step":1}')
    with pytest.raises(AuthError):
        s2.open_line(line.replace(b'"step":1', b'"step":9'))  # altered
    with pytest.raises(AuthError):
        c2.open_line(c2.seal_line(b'{"n":3}'))  # reflected to its sender
    with pytest.raises(AuthError):
        s2.open_line(b'{"op":"hello"}\n')  # no MAC at all


def test_asyncio_server_and_blocking_client_interoperate() -> None:
    secret = JobSecret.generate()

    async def main() -> tuple[Session, Session]:
        got: asyncio.Future[Session] = asyncio.get_running_loop().create_future()

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            got.set_result(await server_handshake_async(r, w, secret, "coordinator"))

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sock = socket.create_connection(("127.0.0.1", port))
        client = await asyncio.to_thread(client_handshake, sock, secret, "coordinator")
        s = await asyncio.wait_for(got, 5)
        sock.close()
        server.close()
        return s, client

    s, c = asyncio.run(main())
    assert s.open_line(c.seal_line(b"x")) == b"x"


def test_asyncio_client_against_a_wrong_secret_fails() -> None:
    async def main() -> BaseException | None:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await server_handshake_async(r, w, JobSecret.generate(), "coordinator")
            except AuthError:
                w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            await client_handshake_async(r, w, JobSecret.generate(), "coordinator")
        except AuthError as e:
            return e
        finally:
            w.close()
            server.close()
        return None

    assert isinstance(asyncio.run(main()), AuthError)


def test_secret_file_round_trip_and_permissions(tmp_path: Path) -> None:
    secret = JobSecret.generate()
    path = secret.write(tmp_path / "job" / "secret")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert JobSecret.load(path).key == secret.key
    assert JobSecret.from_env({ENV_SECRET_FILE: str(path)}).key == secret.key  # type: ignore[union-attr]
    assert JobSecret.from_env({}) is None
    assert "redacted" in repr(secret) and secret.key.hex() not in repr(secret)
    with pytest.raises(FileExistsError):
        secret.write(path)  # never overwrites a job's secret
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        JobSecret.load(path)
    bad = tmp_path / "bad"
    bad.write_text("not hex\n")
    os.chmod(bad, 0o600)
    with pytest.raises(ConfigError, match="hex"):
        JobSecret.load(bad)
    with pytest.raises(ConfigError, match=ENV_SECRET_FILE):
        JobSecret.required({})


def test_tcp_connections_send_each_write_at_once() -> None:
    """The handshake sets TCP_NODELAY at both ends: the client's proof and its first request are
    two writes before it reads, and with Nagle's algorithm the request waited 40 ms for the
    listener's delayed ACK (a catch-up's fetch of 25 MB took 60 ms, 41 of them there)."""
    secret = JobSecret.generate()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname()[:2])
    server, _ = listener.accept()
    listener.close()
    assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # the kernel's default
    results: list[Any] = [None]
    t = threading.Thread(target=lambda: results.__setitem__(0, server_handshake(server, secret, "transfer")))
    t.start()
    try:
        assert isinstance(client_handshake(client, secret, "transfer"), Session)
        t.join(10)
        assert isinstance(results[0], Session)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        client.close()
        server.close()
