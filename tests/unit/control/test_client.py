"""A replica's coordinator connection survives what a coordinator (or an impostor) may send.

The coordinator here is a fake: a loopback socket driven by the test, line by line, that holds
the job's secret (or not, for the impostor).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from unbroken.control import protocol
from unbroken.control.client import CoordinatorClient, CoordinatorUnreachable
from unbroken.wire.auth import AuthError, JobSecret, Session, server_handshake

SECRET = JobSecret.generate()
HELLO = {"replica": 1, "rank": 0, "world_size": 1, "transfer_addr": ""}


class FakeCoordinator:
    def __init__(self, secret: JobSecret = SECRET) -> None:
        self.secret = secret
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(20)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.conn: socket.socket | None = None
        self.session: Session | None = None

    def accept(self) -> dict[str, Any]:
        """Takes the next connection, authenticates it and answers its hello."""
        self.conn, _ = self.server.accept()
        self.conn.settimeout(20)
        self.session = server_handshake(self.conn, self.secret, protocol.PURPOSE)
        self.lines = self.conn.makefile("rb")
        hello = self.next("hello")
        self.send({"op": "welcome", "store": "127.0.0.1:1", "epoch": 0})
        return hello

    def next(self, op: str) -> dict[str, Any]:
        assert self.session is not None
        while True:
            msg = protocol.decode(self.lines.readline(), self.session)
            if msg["op"] == op:
                return msg

    def send(self, msg: dict[str, Any]) -> None:
        assert self.conn is not None and self.session is not None
        self.conn.sendall(protocol.encode(msg, self.session))

    def send_raw(self, payload: bytes) -> None:
        """An authentic line whose content is whatever the test says."""
        assert self.conn is not None and self.session is not None
        self.conn.sendall(self.session.seal_line(payload))

    def answer(self, request: dict[str, Any]) -> None:
        decision = {"epoch": 4, "step": request["step"], "members": [0, 1], "behind": [], "donors": []}
        self.send(
            {"op": "quorum", "id": request["id"], "decision": decision, "transfer_addrs": {}, "store": "127.0.0.1:1"}
        )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


def test_a_bad_line_is_skipped_and_the_reader_keeps_serving() -> None:
    fake = FakeCoordinator()
    client = CoordinatorClient(
        fake.address, SECRET, HELLO, on_abort=lambda epoch: None, heartbeat_s=0.1, reconnect_timeout_s=20
    )
    try:
        fake.accept()
        client.wait_connected(20)
        assert fake.conn is not None
        fake.send_raw(b"this is not json")
        fake.send({"op": "quorum", "id": 1, "decision": {"epoch": "x"}})  # a malformed answer
        future = client.request_quorum(5)
        fake.answer(fake.next("quorum"))
        assert future.result(timeout=20)["decision"]["step"] == 5
    finally:
        client.close(finished=False)
        fake.close()


def test_a_connection_that_keeps_sending_garbage_is_dropped_and_reconnected() -> None:
    fake = FakeCoordinator()
    client = CoordinatorClient(
        fake.address, SECRET, HELLO, on_abort=lambda epoch: None, heartbeat_s=0.1, reconnect_timeout_s=20
    )
    try:
        fake.accept()
        client.wait_connected(20)
        future = client.request_quorum(9)
        assert fake.conn is not None
        fake.conn.sendall(b"x" * (protocol.MAX_LINE + 2))  # one endless line
        first = fake.conn
        assert fake.accept()["op"] == "hello"  # the client came back on a new connection...
        first.close()
        fake.answer(fake.next("quorum"))  # ...and re-sent its pending request there
        assert future.result(timeout=20)["decision"]["step"] == 9
        for _ in range(30):
            fake.send({"op": "abort", "epoch": -1})
        assert fake.accept()["op"] == "hello"  # a flood of malformed messages: dropped again
    finally:
        client.close(finished=False)
        fake.close()


def test_a_forged_line_ends_the_connection_and_the_client_reconnects() -> None:
    fake = FakeCoordinator()
    client = CoordinatorClient(fake.address, SECRET, HELLO, heartbeat_s=0.1, reconnect_timeout_s=20)
    aborts: list[int] = []
    client.on_abort = aborts.append
    try:
        fake.accept()
        client.wait_connected(20)
        assert fake.conn is not None
        first = fake.conn
        first.sendall(json.dumps({"op": "abort", "epoch": 3}).encode() + b"\n")  # no MAC: injected
        assert fake.accept()["op"] == "hello"  # dropped, and back on a new, authenticated connection
        first.close()
        fake.send({"op": "abort", "epoch": 4})
        for _ in range(200):
            if aborts:
                break
            time.sleep(0.01)
        assert aborts == [4], "only the authentic abort may reach the exchange"
    finally:
        client.close(finished=False)
        fake.close()


def test_a_listener_without_the_secret_is_no_coordinator() -> None:
    impostor = FakeCoordinator(JobSecret.generate())
    client = CoordinatorClient(impostor.address, SECRET, HELLO, heartbeat_s=0.1, reconnect_timeout_s=20)
    try:
        with pytest.raises(AuthError):
            impostor.accept()  # the client's proof does not verify with the impostor's key
        with pytest.raises(CoordinatorUnreachable):
            client.wait_connected(0.5)
    finally:
        client.close(finished=False)
        impostor.close()
