"""A node agent's relay between real rank clients and a real coordinator, on loopback sockets.

The coordinator and the relay run in the test's event loop, as in their processes; each rank is
a real :class:`~unbroken.control.client.CoordinatorClient` (its own thread, blocking sockets),
given the relay's address first, as the agent gives it. What is checked is what the ranks and the
operator see: the ranks are served through one node connection, a relay that fails sends them to
the coordinator directly, a lost node connection has them announced again on the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.live_coordinator import live_coordinator
from unbroken.control.client import CoordinatorClient
from unbroken.control.coordinator import Coordinator
from unbroken.launch.node.relay import Relay
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()
REPLICAS, RANKS = 2, 2


def rank_clients(addresses: str) -> list[CoordinatorClient]:
    """A real client for every rank of the node's replicas, given ``addresses`` (the relay's first)."""
    return [
        CoordinatorClient(
            addresses,
            SECRET,
            {"replica": r, "rank": k, "world_size": RANKS, "transfer_addr": "", "node": "n1"},
            heartbeat_s=0.1,
            reconnect_timeout_s=20,
        )
        for r in range(REPLICAS)
        for k in range(RANKS)
    ]


def run(state_dir: Path, scenario: Callable[[Coordinator, Relay, list[CoordinatorClient]], Awaitable[None]]) -> None:
    async def main() -> None:
        settings: dict[str, Any] = {"heartbeat_timeout_s": 30.0, "suspect_after_s": 15.0}
        async with live_coordinator(state_dir, SECRET, total_replicas=REPLICAS, min_replicas=1, **settings) as c:
            relay = Relay("n1", c.address, SECRET)
            await relay.start()
            clients = rank_clients(f"{relay.address},{c.address}")
            try:
                await asyncio.wait_for(scenario(c, relay, clients), 30)
            finally:
                for client in clients:
                    await asyncio.to_thread(client.close, False)
                relay.close()

    asyncio.run(main())


async def step(clients: list[CoordinatorClient], n: int) -> list[dict[str, Any]]:
    """Every rank asks for the quorum of step ``n``; their answers."""
    futures = [asyncio.wrap_future(client.request_quorum(n)) for client in clients]
    return await asyncio.wait_for(asyncio.gather(*futures), 10)


async def until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def served_directly(c: Coordinator) -> int:
    """Rank connections the coordinator serves on their own (not through a node)."""
    return sum(1 for ranks in c.replicas.values() for conn in ranks.values() if type(conn.link).__name__ == "Link")


def test_ranks_are_served_through_one_node_connection(tmp_path: Path) -> None:
    async def scenario(c: Coordinator, relay: Relay, clients: list[CoordinatorClient]) -> None:
        for client in clients:
            await asyncio.to_thread(client.wait_connected, 10)
        assert c.status()["nodes"] == {"n1": REPLICAS * RANKS}
        assert len(c.connections.open) == 1 and served_directly(c) == 0  # one node connection, no rank's own
        first = await step(clients, 1)
        assert {a["decision"]["epoch"] for a in first} == {1} and sorted(first[0]["decision"]["members"]) == [0, 1]
        again = await step(clients, 2)  # the fast path's short answers, completed by each client
        assert {a["decision"]["step"] for a in again} == {2} and {a["decision"]["epoch"] for a in again} == {1}
        # A rank's goodbye is relayed: the coordinator knows it finished, not that it failed.
        await asyncio.to_thread(clients[0].close, True)
        events = c.settings.state_dir / "events.jsonl"
        await until("the bye", lambda: '"replica_finished"' in events.read_text())
        assert '"replica_evicted"' not in events.read_text()
        assert relay.connections == 1

    run(tmp_path, scenario)


def test_a_relay_that_fails_sends_its_ranks_to_the_coordinator_directly(tmp_path: Path) -> None:
    async def scenario(c: Coordinator, relay: Relay, clients: list[CoordinatorClient]) -> None:
        for client in clients:
            await asyncio.to_thread(client.wait_connected, 10)
        await step(clients, 1)

        def broken(*_: Any) -> Any:
            raise RuntimeError("a bug in the relay")

        relay.book.fan_out = broken  # type: ignore[method-assign]  # the next answer finds it
        asked = [asyncio.wrap_future(client.request_quorum(2)) for client in clients]
        await until("the ranks on their own connections", lambda: served_directly(c) == REPLICAS * RANKS)
        assert relay.failed == "RuntimeError: a bug in the relay" and c.status()["nodes"] == {}
        # Their node connection closed: the coordinator evicted its replicas, as it does when a
        # rank's own connection closes. Back on their own connections they train on: both in the
        # first epoch formed, or (the other's ranks back after it formed) one of them a newcomer
        # that catches up in the epoch that takes it back.
        done, _ = await asyncio.wait(asked, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        first = next(iter(done)).result()["decision"]
        ahead = [client for client in clients if client.hello.replica in first["members"]]
        assert first["step"] == 2 and len(ahead) in (RANKS, REPLICAS * RANKS), first
        later = await step(ahead, 3)
        await asyncio.wait_for(asyncio.gather(*asked), 10)  # the newcomer's request too
        assert sorted(later[0]["decision"]["members"]) == [0, 1]

    run(tmp_path, scenario)


def test_a_lost_node_connection_announces_the_ranks_again_on_the_next(tmp_path: Path) -> None:
    async def scenario(c: Coordinator, relay: Relay, clients: list[CoordinatorClient]) -> None:
        for client in clients:
            await asyncio.to_thread(client.wait_connected, 10)
        await step(clients, 1)
        c.connections.close_all()  # the coordinator ends the node connection (as a fenced one does)
        await until("a second node connection", lambda: relay.connections == 2)
        await until("the ranks announced again", lambda: c.status()["nodes"] == {"n1": REPLICAS * RANKS})
        answers = await step(clients, 2)
        assert {a["decision"]["step"] for a in answers} == {2}
        assert served_directly(c) == 0

    run(tmp_path, scenario)


@pytest.mark.parametrize("who", ["a stranger", "a key holder for another job"])
def test_the_relay_admits_no_one_without_the_job_s_secret(tmp_path: Path, who: str) -> None:
    async def scenario(c: Coordinator, relay: Relay, clients: list[CoordinatorClient]) -> None:
        from unbroken.control import protocol
        from unbroken.wire.auth import AuthError

        host, port = relay.address.rsplit(":", 1)
        if who == "a stranger":
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
            assert await asyncio.wait_for(reader.read(), 10) == b"N"  # refused, closed: no line read
            writer.close()
        else:
            with pytest.raises(AuthError):
                await protocol.connect_async(host, int(port), JobSecret.generate())
        assert relay.server.auth_failures == 1

    run(tmp_path, scenario)


def test_a_standby_told_beforehand_takes_the_node_over_with_every_rank_connection_kept(tmp_path: Path) -> None:
    # The active coordinator hangs (here: lives on, unheard of); its lease lapses and the standby
    # takes over. The relay told the standby its node's hello beforehand: the standby registers
    # the ranks as it takes over, its welcome on the warm connection moves the relay onto it, and
    # no rank reconnects or says hello again. Their next step is answered by the standby.
    from unbroken.control.coordinator import CoordinatorSettings
    from unbroken.control.nodes.node_relay import PreSaid
    from unbroken.control.protocol.serving import ConnectionServer

    async def main() -> None:
        settings: dict[str, Any] = {"heartbeat_timeout_s": 30.0, "suspect_after_s": 15.0}
        presaid = PreSaid("127.0.0.1")
        held: ConnectionServer[Any, Any] = ConnectionServer(
            SECRET, 64, 10.0, dispatch=lambda msg, link, c, a: ("stop", c, a), closed=lambda c, a: None
        )
        held.hold(presaid)
        listener = await asyncio.start_server(held.serve, "127.0.0.1", 0)
        standby_address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
        async with live_coordinator(tmp_path / "a", SECRET, total_replicas=REPLICAS, min_replicas=1, **settings) as c:
            relay = Relay("n1", f"{c.address},{standby_address}", SECRET)
            await relay.start()
            clients = rank_clients(f"{relay.address},{c.address},{standby_address}")
            standby = None
            try:
                for client in clients:
                    await asyncio.to_thread(client.wait_connected, 10)
                first = await step(clients, 1)
                epoch = first[0]["decision"]["epoch"]

                def told() -> list[tuple[int, int | None]]:
                    return [(len(conns), said) for _, runs in presaid.nodes.values() for conns, said in runs]

                # told again a while after the epoch its ranks train in changed (RESAY_S)
                await until("the standby told every rank and its epoch", lambda: told() == [(2, epoch), (2, epoch)])
                rank_links = set(relay.server.open)
                standby = Coordinator(
                    CoordinatorSettings(state_dir=tmp_path / "b", total_replicas=REPLICAS, min_replicas=1, **settings),
                    SECRET,
                    listening=(held, listener),
                    presaid=presaid,
                )
                await standby.start()  # registers the node's ranks at once, and welcomes them
                assert {r: sorted(ranks) for r, ranks in standby.replicas.items()} == {0: [0, 1], 1: [0, 1]}
                await until("the relay moved onto the standby", lambda: relay.kept == 1)
                answers = await step(clients, 2)
                assert all(a["decision"]["step"] == 2 for a in answers)
                assert set(relay.server.open) == rank_links  # no rank connection closed or made
                assert standby.status()["nodes"] == {"n1": REPLICAS * RANKS} and served_directly(standby) == 0
                assert relay.warm_used == 1 and relay.failed is None
            finally:
                for client in clients:
                    await asyncio.to_thread(client.close, False)
                relay.close()
                if standby is not None:
                    await standby.stop()
                listener.close()

    asyncio.run(asyncio.wait_for(main(), 60))
