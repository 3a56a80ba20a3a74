"""Protocol fuzzing of a live coordinator (issue 16), with Hypothesis.

A real coordinator serves on loopback in a thread of its own, with two real replicas
(``CoordinatorClient``) in an epoch. Random bytes, random JSON and mutations of every valid
message are thrown at it, without the key and, mutated, on an authenticated connection of a
registered member. It must never crash, its membership must never change without the key (and
the two real replicas are never touched by anyone else's messages), it must answer a status
request after every batch, and the real replicas' next quorum must still complete afterwards.
Over 10,000 messages per run: each example draws a few structured messages from Hypothesis's
strategies and a Hypothesis-seeded ``Random`` that mutates many more cheaply (Hypothesis's own
drawing costs milliseconds per JSON message, too slow for ten thousand in seconds).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import socket
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.control import protocol
from unbroken.control.client import CoordinatorClient
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.wire.auth import JobSecret

T = TypeVar("T")
SECRET = JobSecret.generate()
FUZZ = settings(
    database=None,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Every message a client may send, valid; the mutations start from these.
VALID: list[dict[str, Any]] = [
    {"op": "hello", "replica": 2, "rank": 0, "world_size": 1, "transfer_addr": "127.0.0.1:1", "step": 0},
    {"op": "heartbeat", "step": 3, "compute_s": 0.1},
    {"op": "quorum", "id": 1, "step": 0, "failed_epoch": None, "step_time": 0.2},
    {"op": "quorum", "id": 2, "step": 1, "failed_epoch": 1, "step_time": None},
    {
        "op": "telemetry",
        "now_ns": 1,
        "records": [["g", 1, "allreduce", 8, 1, 2, True, [0, 1], 0, 0]],
        "open": ["g", 2, "allreduce", 8, 3, 0, False, [0, 1], 0, 0],
    },
    {"op": "bye"},
    {"op": "exited", "replica": 2, "exitcode": 1},
    {"op": "exited", "replica": 0, "exitcode": 9},
    {"op": "status"},
    {"op": "agent_hello", "node": "n0", "slots": 1, "running": [0, 1]},
    {"op": "agent_heartbeat"},
    {"op": "stack", "replica": 0, "rank": 0, "stack": "x"},
]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -0.0, 2**62, 2**63]),
    st.text(max_size=20),
    st.sampled_from(["hello", "quorum", "exited", "bye", "status", "agent_hello"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    msg = dict(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["set", "drop", "add", "op"]))
        keys = sorted(msg)
        if kind == "set" and keys:
            msg[draw(st.sampled_from(keys))] = draw(json_values)
        elif kind == "drop" and keys:
            msg.pop(draw(st.sampled_from(keys)))
        elif kind == "add":
            msg[draw(st.text(max_size=8))] = draw(json_values)
        else:
            msg["op"] = draw(st.one_of(st.sampled_from([m["op"] for m in VALID]), json_scalars))
    return msg


def line_of(msg: Any) -> bytes:
    return json.dumps(msg).encode()


NASTY: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    3,
    2**62,
    2**63,
    -(2**70),
    0.5,
    1e308,
    -1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    "",
    "x" * 300,
    "../../../etc/passwd",
    "\u0000",
    "hello",
    "quorum",
    "bye",
    "exited",
    "agent_hello",
    [],
    {},
    [0, 1],
    {"op": "bye"},
]


def quick_value(rnd: random.Random, depth: int = 0) -> Any:
    roll = rnd.random()
    if depth < 2 and roll < 0.15:
        return [quick_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    if depth < 2 and roll < 0.3:
        return {rnd.choice(["op", "replica", "step", "id", "x"]): quick_value(rnd, depth + 1) for _ in range(3)}
    return rnd.choice(NASTY)


def quick_payload(rnd: random.Random) -> bytes:
    """One fuzz line, cheaply: a mutated valid message, random JSON, or random bytes."""
    roll = rnd.random()
    if roll < 0.6:
        msg = copy.deepcopy(rnd.choice(VALID))
        for _ in range(rnd.randint(1, 3)):
            keys = sorted(msg)
            what = rnd.random()
            if what < 0.5 and keys:
                msg[rnd.choice(keys)] = quick_value(rnd)
            elif what < 0.7 and keys:
                msg.pop(rnd.choice(keys))
            elif what < 0.85:
                msg[rnd.choice(["pid", "stack_file", "extra", "replica", "rank"])] = quick_value(rnd)
            else:
                msg["op"] = rnd.choice([m["op"] for m in VALID] + NASTY[:8])
        return line_of(msg)
    if roll < 0.8:
        return line_of(quick_value(rnd))
    return rnd.randbytes(rnd.randint(0, 200)).replace(b"\n", b" ")


payloads = st.one_of(
    mutated().map(line_of),
    json_values.map(line_of),
    st.binary(max_size=200).map(lambda b: b.replace(b"\n", b" ")),
)


class Live:
    """A coordinator on its own event loop thread, as in `unbroken coordinator`."""

    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> Coordinator:
            c = Coordinator(
                CoordinatorSettings(
                    total_replicas=3,
                    min_replicas=2,
                    state_dir=state_dir,
                    startup_window_s=0.5,
                    heartbeat_timeout_s=30.0,
                    suspect_after_s=10.0,
                    hello_timeout_s=5.0,
                ),
                SECRET,
            )
            await c.start()
            return c

        self.c = self.run(start())
        host, port = self.c.address.rsplit(":", 1)
        self.host, self.port = host, int(port)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 20.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def read(self, fn: Callable[[Coordinator], T]) -> T:
        """Reads coordinator state on its own thread."""

        async def call() -> T:
            return fn(self.c)

        return self.run(call())

    def members(self) -> dict[int, list[int]]:
        return self.read(lambda c: {r: sorted(ranks) for r, ranks in c.replicas.items()})

    def status(self) -> dict[str, Any]:
        return protocol.request(self.host, self.port, SECRET, {"op": "status"}, timeout=10.0)

    def close(self) -> None:
        try:
            self.run(self.c.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def exchange(sock: socket.socket, data: bytes) -> bytes:
    """Sends ``data``, returns what comes back until the coordinator closes; a reset (it closed
    with our lines unread, as it does to a connection it drops) is an end like any other."""
    got = b""
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        while chunk := sock.recv(1 << 16):
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return got


@pytest.fixture
def live(tmp_path: Path) -> Any:
    live = Live(tmp_path / "state")
    hello = {"rank": 0, "world_size": 1, "transfer_addr": ""}
    clients = [CoordinatorClient(live.c.address, SECRET, {"replica": r, **hello}, heartbeat_s=0.1) for r in (0, 1)]
    try:
        for client in clients:
            client.wait_connected(20)
        first = [f.result(timeout=20)["decision"] for f in [client.request_quorum(0) for client in clients]]
        assert first[0]["members"] == [0, 1]
        yield live, clients
        # Still responsive: the real replicas' next quorum completes after the barrage.
        after = [f.result(timeout=20)["decision"] for f in [client.request_quorum(1) for client in clients]]
        # Donor pairs go only to the members they name (a fuzzed replica may have joined behind).
        same = [{k: v for k, v in a.items() if k != "donors"} for a in after]
        assert same[0] == same[1] and {0, 1} <= set(after[0]["members"])
    finally:
        for client in clients:
            client.close(finished=False)
        live.close()


def test_fuzz_without_the_key(live: Any) -> None:
    live_, _ = live
    before = live_.members()
    sent = [0]

    @settings(FUZZ, max_examples=100)
    @given(
        st.lists(st.one_of(payloads, payloads.map(lambda p: p + b"\n" + p)), min_size=1, max_size=3),
        st.randoms(use_true_random=False),
    )
    def barrage(drawn: list[bytes], rnd: random.Random) -> None:
        batch = drawn + [quick_payload(rnd) for _ in range(8)]
        for payload in batch:  # each on a connection of its own: a keyless one is dropped at once
            with socket.create_connection((live_.host, live_.port), timeout=10) as s:
                exchange(s, payload + b"\n")
            sent[0] += 1
        assert live_.members() == before, "membership changed without the key"

    barrage()
    assert live_.status()["auth_failures"] >= sent[0]  # every one dropped, and it still answers
    assert sent[0] >= 900, sent[0]


def test_fuzz_of_an_authenticated_member(live: Any) -> None:
    live_, _ = live
    sent, welcomed = [0], [0]

    @settings(FUZZ, max_examples=120)
    @given(st.lists(payloads, min_size=1, max_size=4), st.randoms(use_true_random=False), st.booleans())
    def barrage(drawn: list[bytes], rnd: random.Random, forge_last: bool) -> None:
        batch = drawn + [quick_payload(rnd) for _ in range(80)]
        sock, session = protocol.connect(live_.host, live_.port, SECRET, timeout=10)
        with sock:
            hello = {"op": "hello", "replica": 2, "rank": 0, "world_size": 1, "transfer_addr": ""}
            data = protocol.encode(hello, session) + b"".join(session.seal_line(p) for p in batch)
            if forge_last:
                data += line_of({"op": "exited", "replica": 0}) + b"\n"  # no MAC: dropped
            answer = exchange(sock, data)
            sent[0] += len(batch) + 1
        if answer:
            assert protocol.decode(answer.split(b"\n", 1)[0] + b"\n", session)["op"] == "welcome"
            welcomed[0] += 1
        members = live_.members()
        assert members.get(0) == [0] and members.get(1) == [0], f"a member spoke for the others: {members}"
        assert 2 not in live_.read(lambda c: c.replicas), "the fuzzing member's connection is gone"
        if sent[0] // 81 % 10 == 0:
            assert live_.status()["op"] == "status"  # answers a new, authenticated client

    barrage()
    assert sent[0] >= 9500, sent[0]
    assert welcomed[0] >= 100, "the fuzzing member was not served"
