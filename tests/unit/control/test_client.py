"""A replica's coordinator connection survives what a coordinator (or an impostor) may send.

The coordinator here is a fake: a loopback socket driven by the test, line by line, that holds
the job's secret (or not, for the impostor).
"""

from __future__ import annotations

import contextlib
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

    def accept(self, term: int | None = None) -> dict[str, Any]:
        """Takes the next connection, authenticates it and answers its hello (in lease ``term``)."""
        self.conn, _ = self.server.accept()
        self.conn.settimeout(20)
        self.session = server_handshake(self.conn, self.secret, protocol.PURPOSE)
        self.lines = self.conn.makefile("rb")
        hello = self.next("hello")
        self.send({"op": "welcome", "store": "127.0.0.1:1", "epoch": 0, **({"term": term} if term else {})})
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
        first = fake.conn
        # The client may drop the connection before the whole line is sent (it reads faster on
        # more cores): a reset here is the outcome under test, not a failure.
        with contextlib.suppress(OSError):
            first.sendall(b"x" * (protocol.MAX_LINE + 2))  # one endless line
        assert fake.accept()["op"] == "hello"  # the client came back on a new connection...
        first.close()
        fake.answer(fake.next("quorum"))  # ...and re-sent its pending request there
        assert future.result(timeout=20)["decision"]["step"] == 9
        with contextlib.suppress(OSError):  # dropped mid-flood, as on a fast machine
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


def test_members_sent_as_runs_are_listed_for_the_training_thread() -> None:
    fake = FakeCoordinator()
    client = CoordinatorClient(fake.address, SECRET, HELLO, heartbeat_s=0.5)
    try:
        fake.accept()
        future = client.request_quorum(5)
        request = fake.next("quorum")
        decision = {"epoch": 4, "step": 5, "member_runs": [[0, 2], [4, 6]], "behind_runs": [[6, 6]], "donors": [[6, 0]]}
        fake.send({"op": "quorum", "id": request["id"], "decision": decision, "transfer_addrs": {}, "store": "s:1"})
        got = future.result(timeout=20)["decision"]
        assert got["members"] == [0, 1, 2, 4, 5, 6] and got["behind"] == [6] and got["donors"] == [[6, 0]]
        assert "member_runs" not in got and "behind_runs" not in got
        # The next step's short answer is completed from it, members and all.
        future = client.request_quorum(6)
        fake.send(protocol.QuorumSame(id=fake.next("quorum")["id"], same_epoch=4, step=6).to_msg())
        assert future.result(timeout=20)["decision"]["members"] == [0, 1, 2, 4, 5, 6]
    finally:
        client.close(finished=False)
        fake.close()


def test_a_client_asking_every_period_sends_no_heartbeat_line_of_its_own() -> None:
    # Any line is a heartbeat at the coordinator: a rank that asks for a quorum within every
    # heartbeat period needs no heartbeat line; once it stops asking, it heartbeats again.
    fake = FakeCoordinator()
    period = 0.6
    client = CoordinatorClient(fake.address, SECRET, HELLO, heartbeat_s=period)
    try:
        fake.accept()
        assert fake.conn is not None and fake.session is not None
        for step in range(8):  # an ask every sixth of a period
            client.request_quorum(step)
            time.sleep(period / 6)
        time.sleep(2.0)  # then nothing from the training thread
        fake.conn.settimeout(0.5)
        ops: list[str] = []
        with contextlib.suppress(TimeoutError, OSError):
            while True:
                ops.append(protocol.decode(fake.lines.readline(), fake.session)["op"])
        first, last = ops.index("quorum"), len(ops) - 1 - ops[::-1].index("quorum")
        assert ops.count("quorum") == 8, ops
        assert ops[:first].count("heartbeat") <= 1, ops  # the one due as the connection opened
        assert "heartbeat" not in ops[first:last], ops
        assert ops[last:].count("heartbeat") >= 2, ops
    finally:
        client.close(finished=False)
        fake.close()


def test_after_a_lost_coordinator_the_hello_says_the_epoch_the_rank_trains_in() -> None:
    # What a restarted coordinator or a standby continues (control.resume): the epoch of the
    # last answer, or of an epoch pushed since; none before any.
    fake = FakeCoordinator()
    client = CoordinatorClient(fake.address, SECRET, HELLO, heartbeat_s=0.5, reconnect_timeout_s=20)
    try:
        assert "epoch" not in fake.accept()
        future = client.request_quorum(5)
        fake.answer(fake.next("quorum"))
        future.result(timeout=20)
        assert fake.conn is not None
        fake.conn.shutdown(socket.SHUT_RDWR)  # the coordinator is gone
        assert fake.accept()["epoch"] == 4
        decision = {"epoch": 9, "step": 6, "member_runs": [[0, 1]], "behind_runs": [], "donors": []}
        fake.send({"op": "epoch", "abort": 4, "decision": decision, "transfer_addrs": {}, "store": "s:1"})
        time.sleep(0.2)
        fake.conn.shutdown(socket.SHUT_RDWR)
        assert fake.accept()["epoch"] == 9
    finally:
        client.close(finished=False)
        fake.close()


def test_drain_returns_once_an_abort_that_arrived_is_handled() -> None:
    # What a commit relies on after a stop (train.vote): an abort already in the socket is read
    # before the step is applied, even while the connection thread is busy with an earlier line.
    fake = FakeCoordinator()
    aborted: list[int] = []

    def slow_donate(to: int) -> None:
        time.sleep(0.15)  # the connection thread is held up, as after a SIGCONT before it runs

    client = CoordinatorClient(
        fake.address, SECRET, HELLO, on_abort=aborted.append, on_donate=slow_donate, heartbeat_s=0.5
    )
    try:
        fake.accept()
        client.wait_connected(20)
        assert fake.conn is not None and fake.session is not None
        donate = protocol.encode({"op": "donate", "to": 2}, fake.session)
        fake.conn.sendall(donate + protocol.encode({"op": "abort", "epoch": 7}, fake.session))
        time.sleep(0.05)  # both lines are here; the thread is still in the first one's handler
        assert aborted == []
        client.drain()
        assert aborted == [7]
    finally:
        client.close(finished=False)
        fake.close()


def test_a_pushed_epoch_says_which_step_follows_the_one_it_aborts() -> None:
    # An epoch pushed after a death trains the step the survivors reached: one past a step whose
    # sum completed everywhere, which a member voting late may then still apply (train.vote).
    fake = FakeCoordinator()
    client = CoordinatorClient(fake.address, SECRET, HELLO, heartbeat_s=0.5)
    try:
        fake.accept()
        client.wait_connected(20)
        assert client.next_step_after(4) is None
        decision = {"epoch": 5, "step": 6, "member_runs": [[0, 1]], "behind_runs": [], "donors": []}
        fake.send({"op": "epoch", "abort": 4, "decision": decision, "transfer_addrs": {}, "store": "s:1"})
        deadline = time.monotonic() + 10
        while client.next_step_after(4) is None and time.monotonic() < deadline:
            client.drain()
        assert client.next_step_after(4) == 6
        assert client.next_step_after(5) is None  # no push followed an abort of epoch 5
    finally:
        client.close(finished=False)
        fake.close()


def test_a_coordinator_of_an_older_term_is_dropped_unheard() -> None:
    # The fencing token: once answered in term 2, nothing a term-1 coordinator says is taken (a
    # replaced one that still listens, with an answer queued before it stepped down).
    new, old, newer = FakeCoordinator(), FakeCoordinator(), FakeCoordinator()
    client = CoordinatorClient(
        f"{new.address},{old.address},{newer.address}", SECRET, HELLO, heartbeat_s=0.5, reconnect_timeout_s=20
    )
    try:
        new.accept(term=2)
        first = client.request_quorum(5)
        new.answer(new.next("quorum"))
        assert first.result(timeout=20)["term"] == 2 and client.term == 2
        pending = client.request_quorum(6)
        new.close()  # the term-2 coordinator is gone; the client tries the next address
        old.accept(term=1)
        old.answer({"id": 2, "step": 6})  # queued before it stepped down: must not be taken
        newer.accept(term=3)  # the client left the old one for the next address
        newer.answer(newer.next("quorum"))
        got = pending.result(timeout=20)
        assert got["term"] == 3 and got["decision"]["step"] == 6 and client.term == 3
    finally:
        client.close(finished=False)
        for fake in (new, old, newer):
            fake.close()
