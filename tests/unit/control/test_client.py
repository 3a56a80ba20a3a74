"""A replica's coordinator connection survives what a coordinator (or an impostor) may send.

The coordinator here is a fake: a loopback socket driven by the test, line by line.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from unbroken.control import protocol
from unbroken.control.client import CoordinatorClient

HELLO = {"replica": 1, "rank": 0, "world_size": 1, "transfer_addr": ""}


class FakeCoordinator:
    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(20)
        self.address = "127.0.0.1:%d" % self.server.getsockname()[1]
        self.conn: socket.socket | None = None

    def accept(self) -> dict[str, Any]:
        """Takes the next connection and answers its hello."""
        self.conn, _ = self.server.accept()
        self.conn.settimeout(20)
        self.lines = self.conn.makefile("rb")
        hello = self.next("hello")
        self.send({"op": "welcome", "store": "127.0.0.1:1", "epoch": 0})
        return hello

    def next(self, op: str) -> dict[str, Any]:
        while True:
            msg = json.loads(self.lines.readline())
            if msg["op"] == op:
                return msg

    def send(self, msg: dict[str, Any]) -> None:
        assert self.conn is not None
        self.conn.sendall(protocol.encode(msg))

    def answer(self, request: dict[str, Any]) -> None:
        decision = {"epoch": 4, "step": request["step"], "members": [0, 1], "behind": [], "donors": []}
        self.send({"op": "quorum", "id": request["id"], "decision": decision, "transfer_addrs": {},
                   "store": "127.0.0.1:1"})

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


def test_a_bad_line_is_skipped_and_the_reader_keeps_serving() -> None:
    fake = FakeCoordinator()
    client = CoordinatorClient(fake.address, HELLO, on_abort=lambda epoch: None, heartbeat_s=0.1,
                               reconnect_timeout_s=20)
    try:
        fake.accept()
        client.wait_connected(20)
        assert fake.conn is not None
        fake.conn.sendall(b"this is not json\n")
        fake.send({"op": "quorum", "id": 1, "decision": {"epoch": "x"}})  # a malformed answer
        future = client.request_quorum(5)
        fake.answer(fake.next("quorum"))
        assert future.result(timeout=20)["decision"]["step"] == 5
    finally:
        client.close(finished=False)
        fake.close()


def test_a_connection_that_keeps_sending_garbage_is_dropped_and_reconnected() -> None:
    fake = FakeCoordinator()
    client = CoordinatorClient(fake.address, HELLO, on_abort=lambda epoch: None, heartbeat_s=0.1,
                               reconnect_timeout_s=20)
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
