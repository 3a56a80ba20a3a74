"""A standby told each node's hello beforehand registers the nodes as it takes over (issue 31).

Real sockets on loopback and a real :class:`Coordinator` taking over a held listener: what is
checked is what the takeover relies on. A hello said ``beforehand`` is kept, not answered and not
refused while the standby waits (the latest one of a node stands, one that closed is forgotten);
a hello said to reach a coordinator is still held and refused in bounded time; the moment the
standby serves, the nodes told are registered before any line is read; a node's first line is
welcomed with the answers to the line it said already, or at once if it said none (how its
relay learns of a takeover from a coordinator that hangs).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.live_coordinator import live_coordinator, member, next_op
from unbroken.control import protocol
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.nodes import node_relay
from unbroken.control.nodes.node_relay import PreSaid
from unbroken.control.protocol import serving
from unbroken.control.protocol.serving import ConnectionServer
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()


def node_hello(node: str, replica: int, world_size: int, beforehand: bool = True, **fields: Any) -> dict[str, Any]:
    ranks = tuple(
        protocol.Hello(replica=replica, rank=k, world_size=world_size, node=node, **fields) for k in range(world_size)
    )
    return protocol.NodeHello(node=node, ranks=ranks, beforehand=beforehand).to_msg()


async def held(presaid: PreSaid) -> tuple[ConnectionServer[Any, Any], asyncio.base_events.Server, int]:
    server: ConnectionServer[Any, Any] = ConnectionServer(
        SECRET, 64, 10.0, dispatch=lambda msg, link, c, a: ("stop", c, a), closed=lambda c, a: None, what="the standby"
    )
    server.hold(presaid)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0, limit=protocol.MAX_LINE)
    return server, listener, listener.sockets[0].getsockname()[1]


async def dial(port: int) -> protocol.Link:
    reader, writer, session = await protocol.connect_async("127.0.0.1", port, SECRET, timeout=5.0)
    return protocol.Link(reader, writer, session)


async def until(what: str, check: Any, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout}s: {what}")


async def silent(link: protocol.Link, for_s: float) -> bool:
    try:
        await asyncio.wait_for(link.readline(), for_s)
    except asyncio.TimeoutError:
        return True
    return False


def test_a_hello_said_beforehand_is_kept_the_latest_standing_and_a_plain_one_still_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serving, "HOLD_S", 0.3)

    async def scenario() -> None:
        presaid = PreSaid("127.0.0.1")
        _, listener, port = await held(presaid)
        first = await dial(port)
        first.send(node_hello("n1", 0, 1))
        first.send(node_hello("n1", 0, 2, epoch=3))  # said again: the latest stands
        await until("the latest hello kept", lambda: [len(runs[0][0]) for _, runs in presaid.nodes.values()] == [2])
        (_, runs), *_ = presaid.nodes.values()
        assert [(c.rank, said) for c in runs[0][0] for said in [runs[0][1]]] == [(0, 3), (1, 3)]
        assert await silent(first, 0.5)  # neither answered nor refused while the standby waits
        again = await dial(port)  # the node's agent on a new connection: its hello there replaces this one
        again.send(node_hello("n1", 0, 2, epoch=4))
        await until("the older one forgotten", lambda: [runs[0][1] for _, runs in presaid.nodes.values()] == [4])
        again.close()
        await until("a closed one forgotten", lambda: not presaid.nodes and not presaid.links)
        plain = await dial(port)  # a hello said to reach a coordinator: held, and refused in bounded time
        plain.send(node_hello("n2", 1, 1, beforehand=False))
        line = await asyncio.wait_for(plain.readline(), 5)
        assert line is not None and "not serving" in plain.decode(line)["message"] and not presaid.nodes
        first.close()
        listener.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_the_nodes_told_are_registered_as_the_standby_takes_over_and_welcomed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_relay, "ADOPTED_WELCOME_S", 5.0)

    async def scenario() -> None:
        presaid = PreSaid("127.0.0.1")
        server, listener, port = await held(presaid)
        talker, quiet = await dial(port), await dial(port)
        talker.send(node_hello("n1", 0, 2))
        quiet.send(node_hello("n2", 1, 1))
        await until("both kept", lambda: len(presaid.nodes) == 2)
        # The active coordinator died: n1's relay moved onto this connection and says its ranks'
        # beat (held until the standby serves); n2's has not noticed yet (or its coordinator hangs).
        talker.send(protocol.NodeHeartbeat(beats=((0, 0, 5), (0, 1, 5))).to_msg())
        await until("its line held", lambda: len(server.speaking) == 1)
        settings = CoordinatorSettings(total_replicas=2, min_replicas=1, state_dir=tmp_path)
        # Taken over from a coordinator that hangs (held through its lease): relays move on a welcome.
        c = Coordinator(settings, SECRET, listening=(server, listener), presaid=presaid, held_by_lease=True)
        await c.start()
        try:
            # Registered in start(), before any line is read: no hello in the burst.
            assert {r: sorted(ranks) for r, ranks in c.replicas.items()} == {0: [0, 1], 1: [0]}
            assert c.nodes.status() == {"n1": 2, "n2": 1} and not presaid.nodes
            # n2 is welcomed at once: that is how its relay learns of the takeover.
            line = await asyncio.wait_for(quiet.readline(), 1.0)
            assert line is not None
            assert [m["op"] for m in protocol.NodeAnswers.from_msg(quiet.decode(line)).msgs] == ["welcome"]
            # n1's welcomes leave with what its line is answered (long before ADOPTED_WELCOME_S).
            line = await asyncio.wait_for(talker.readline(), 1.0)
            assert line is not None
            answers = protocol.NodeAnswers.from_msg(talker.decode(line))
            assert answers.to == ((0, 0), (0, 1)) and [m["op"] for m in answers.msgs] == ["welcome", "welcome"]
            assert c.replicas[0][0].step == 5  # its line was read as the adopted node's
            quiet.close()  # an adopted node's connection that ends: its ranks are gone with it
            await until("its replica evicted", lambda: 1 not in c.replicas)
            talker.close()
        finally:
            await c.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


async def trained_one_epoch(state_dir: Path) -> int:
    """A coordinator that formed one epoch of three replicas (the history a standby resumes)."""
    async with live_coordinator(state_dir, SECRET, total_replicas=3, join_window_floor_s=0.3) as c:
        links = [await member(c, SECRET, r) for r in range(3)]
        for link in links:
            link.send(protocol.QuorumAsk(id=1, step=0, step_time=None, failed_epoch=None).to_msg())
        (epoch,) = {(await next_op(link, "quorum"))["decision"]["epoch"] for link in links}
        for link in links:
            link.close()
    return int(epoch)


def test_a_member_told_in_an_older_epoch_claims_it_with_its_relay_s_next_hello_and_the_epoch_stands(
    tmp_path: Path,
) -> None:
    # Its relay told the standby before it heard of the epoch, and says its hello again as it fails
    # over, after the standby took over. Registered as told, its claim would end the resumed epoch
    # for every replica.
    async def scenario() -> None:
        epoch = await trained_one_epoch(tmp_path)
        presaid = PreSaid("127.0.0.1")
        server, listener, port = await held(presaid)
        links = [await dial(port) for _ in range(3)]
        for replica, link in enumerate(links):
            link.send(node_hello(f"n{replica}", replica, 1, epoch=epoch - 1 if replica == 1 else epoch))
        await until("all kept", lambda: len(presaid.nodes) == 3)
        settings = CoordinatorSettings(total_replicas=3, min_replicas=1, state_dir=tmp_path)
        c = Coordinator(settings, SECRET, listening=(server, listener), presaid=presaid)
        await c.start()
        try:
            # n1 registered, without its claim: the epoch resumes, waiting for it to be back
            assert sorted(c.replicas) == [0, 1, 2] and c.resumed is not None and c.resumed.state.back == {0, 2}
            for link in links:
                await next_op(link, "node_answers")  # each welcomed: n1's relay moves over too
            links[1].send(node_hello("n1", 1, 1, epoch=epoch))  # said again as it fails over
            await until("n1 back in the epoch", lambda: c.resumed is None)
            assert c.replicas[1][0].trains == epoch
            links[0].send(node_hello("n0", 0, 1, epoch=epoch))  # told again late: its rank stands, nothing refused
            assert await silent(links[0], 0.3)
            kinds = [json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
            since = kinds[len(kinds) - kinds[::-1].index("coordinator_started") :]  # the standby's own
            assert "resume_given_up" not in since and "replica_evicted" not in since and "quorum" not in since
            for link in links:
                link.close()
        finally:
            await c.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))
