"""A standby holds the node agents' connections before it takes over (issue 31's takeover).

Real sockets on loopback: a :class:`ConnectionServer` told to :meth:`~ConnectionServer.hold`
authenticates connections and serves none of them until :meth:`~ConnectionServer.open_to`; a
relay given a standby keeps one idle connection to it and makes it its next node connection.
What is checked is what a takeover relies on: nothing is answered before the takeover, what was
said is served right after it, a line to a standby that never takes over is refused in bounded
time, and the relay's next node connection costs no new handshake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.live_coordinator import live_coordinator
from unbroken.control import protocol
from unbroken.control.protocol import serving
from unbroken.control.protocol.serving import ConnectionServer
from unbroken.launch.node.relay import Relay
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()


class Rank:
    """A rank's connection to the relay, as far as the relay's book goes."""

    def close(self) -> None:
        pass


def held_server() -> ConnectionServer[Any, Any]:
    server: ConnectionServer[Any, Any] = ConnectionServer(
        SECRET, 16, 10.0, dispatch=lambda msg, link, c, a: ("stop", c, a), closed=lambda c, a: None
    )
    server.hold()
    return server


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


async def listen(server: ConnectionServer[Any, Any]) -> tuple[asyncio.base_events.Server, int]:
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0, limit=protocol.MAX_LINE)
    return listener, listener.sockets[0].getsockname()[1]


async def dial(port: int) -> protocol.Link:
    reader, writer, session = await protocol.connect_async("127.0.0.1", port, SECRET, timeout=5.0)
    return protocol.Link(reader, writer, session)


def test_a_held_connection_is_answered_only_once_the_standby_serves() -> None:
    async def scenario() -> None:
        server, said = held_server(), []
        listener, port = await listen(server)
        link = await dial(port)
        link.send(protocol.StatusRequest().to_msg())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(link.readline(), 0.3)  # held: no answer yet

        def dispatch(msg: dict[str, Any], link: protocol.Link, c: Any, a: Any) -> tuple[str, Any, Any]:
            said.append(msg["op"])
            link.send({"op": "status", "serving": True})
            return msg["op"], c, a

        server.open_to(dispatch, lambda c, a: None)
        line = await asyncio.wait_for(link.readline(), 5)
        assert line is not None and link.decode(line)["serving"] is True and said == ["status"]
        link.close()
        listener.close()

    run(scenario)


def test_a_line_to_a_standby_that_never_serves_is_refused_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "HOLD_S", 0.2)

    async def scenario() -> None:
        server = held_server()
        listener, port = await listen(server)
        link = await dial(port)
        link.send(protocol.StatusRequest().to_msg())
        line = await asyncio.wait_for(link.readline(), 5)
        assert line is not None and "not serving" in link.decode(line)["message"]
        assert await asyncio.wait_for(link.readline(), 5) is None  # and closed: it tries the active one
        listener.close()

    run(scenario)


def test_a_relay_keeps_a_warm_connection_to_the_standby_and_moves_its_node_onto_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        standby = held_server()
        listener, port = await listen(standby)
        async with live_coordinator(tmp_path, SECRET, total_replicas=1) as c:
            relay = Relay("n1", f"{c.address},127.0.0.1:{port}", SECRET)
            await relay.start()
            relay._wanted.set()  # a rank waits to be announced: the relay connects upstream
            for _ in range(100):
                if relay._warm is not None:
                    break
                await asyncio.sleep(0.05)
            assert relay._warm is not None and len(standby.open) == 1  # idle, authenticated, held
            opened_before = len(standby.open)
            got = asyncio.get_running_loop().create_future()

            def dispatch(msg: dict[str, Any], link: protocol.Link, conn: Any, agent: Any) -> tuple[str, Any, Any]:
                if not got.done():
                    got.set_result(msg["op"])
                return msg["op"], conn, agent

            await c.stop()  # the active one goes: its node connection ends
            for _ in range(100):
                if relay._up is None:
                    break
                await asyncio.sleep(0.05)
            standby.open_to(dispatch, lambda conn, agent: None)
            relay.book.hello(Rank(), protocol.Hello(replica=0, rank=0, world_size=1, node="n1"))  # it says hello again
            relay._wanted.set()
            assert await asyncio.wait_for(got, 10) == protocol.NodeHello.OP
            assert relay.warm_used == 1 and len(standby.open) == opened_before  # no new connection, no handshake
            await asyncio.sleep(0.2)
            assert relay.failed is None and relay._up is not None  # and it reads its answers there
            relay.close()
        listener.close()

    run(scenario)


def test_a_forged_line_to_a_standby_is_dropped_before_the_takeover() -> None:
    # The held line's MAC is checked while the standby waits (not in the takeover's burst): a
    # forged one is refused at once, not served once the standby serves.
    async def scenario() -> None:
        server = held_server()
        listener, port = await listen(server)
        link = await dial(port)
        link.writer.write(b'{"op":"status"}\n')  # no valid MAC
        assert await asyncio.wait_for(link.readline(), 5) is None  # closed, with the standby still held
        assert server.auth_failures == 1
        listener.close()

    run(scenario)


def test_a_relay_reaches_for_the_standby_at_once_at_the_start_and_spread_out_after_a_failover() -> None:
    import random

    from unbroken.launch.node.relay import WARM_RETRY_S, first_warm_wait

    assert first_warm_wait(failover=False) == 0.0  # a job's start: the standby is up, nothing to spread
    rng = random.Random(7)
    waits = [first_warm_wait(failover=True, rng=rng) for _ in range(1000)]
    # not in the takeover's burst, and one try of the retry period later at the latest
    assert all(WARM_RETRY_S <= w < 2 * WARM_RETRY_S for w in waits)
    # spread over it: a job's relays do not reach for the coordinator just lost in one instant
    assert sum(w < 1.1 * WARM_RETRY_S for w in waits) < 200 and max(waits) - min(waits) > 0.8 * WARM_RETRY_S
