"""A node agent speaks for its node's ranks through one connection (issue 31).

A real coordinator on loopback; the node's side is spoken by hand, line by line, as the agent
would: what is checked is what an agent relies on (its ranks are admitted, answered in one line
per node, told to abort, evicted alone) and that a node speaks for no rank but its own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.live_coordinator import closed, connect, live_coordinator, member, next_op
from unbroken.control import protocol
from unbroken.control.coordinator import Coordinator
from unbroken.control.nodes.node_relay import NodeConn, answers_payload, hello_runs, slot_json, usable_store
from unbroken.control.protocol.messages import MAX_NODE_RANKS
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.control.state.state_store import StateStore
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()
RANKS = 4


def run(state_dir: Path, scenario: Any, **settings: Any) -> None:
    settings = {"heartbeat_timeout_s": 60.0, "suspect_after_s": 30.0, **settings}

    async def main() -> None:
        async with live_coordinator(state_dir, SECRET, **settings) as c:
            await asyncio.wait_for(scenario(c), 20)

    asyncio.run(main())


def hello(node: str, replica: int, ranks: int = RANKS) -> protocol.NodeHello:
    return protocol.NodeHello(
        node=node,
        ranks=tuple(protocol.Hello(replica=replica, rank=k, world_size=ranks, node=node) for k in range(ranks)),
    )


async def answers(link: protocol.Link) -> protocol.NodeAnswers:
    return protocol.NodeAnswers.from_msg(await next_op(link, "node_answers"))


async def node(c: Coordinator, name: str, replica: int) -> protocol.Link:
    """A node connection whose ranks (all of ``replica``) were welcomed, in one line."""
    link = await connect(c, SECRET)
    link.send(hello(name, replica).to_msg())
    got = await answers(link)
    assert got.to == tuple((replica, k) for k in range(RANKS))
    assert [m["op"] for m in got.msgs] == ["welcome"] * RANKS
    return link


def asks(replica: int, step: int, req_id: int, failed: int | None = None) -> protocol.NodeQuorum:
    ask = protocol.QuorumAsk(id=req_id, step=step, step_time=None, failed_epoch=failed)
    return protocol.NodeQuorum(asks=tuple((replica, k, ask) for k in range(RANKS)))


def test_a_node_s_ranks_are_answered_in_one_line_per_node(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a, b = await node(c, "a", 0), await node(c, "b", 1)
        assert set(c.replicas) == {0, 1} and all(len(r) == RANKS for r in c.replicas.values())
        a.send(asks(0, 5, 1).to_msg())
        b.send(asks(1, 5, 1).to_msg())
        first = await asyncio.gather(answers(a), answers(b))
        for got, replica in zip(first, (0, 1), strict=True):
            assert got.to == tuple((replica, k) for k in range(RANKS))
            assert {m["decision"]["epoch"] for m in got.msgs} == {1} and {m["id"] for m in got.msgs} == {1}
        # The fast path: the next step's answers are the short ones, still one line for the node.
        a.send(asks(0, 6, 2).to_msg())
        b.send(asks(1, 6, 2).to_msg())
        got, _ = await asyncio.gather(answers(a), answers(b))
        assert [m.get("same_epoch") for m in got.msgs] == [1] * RANKS and len(got.to) == RANKS
        assert a.received == b.received == 3  # the welcomes and two answers: one line each for the node

    run(tmp_path, scenario, total_replicas=2, min_replicas=1)


def test_a_node_that_dies_evicts_its_replica_and_the_survivor_gets_the_next_epoch(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a, b = await node(c, "a", 0), await node(c, "b", 1)
        a.send(asks(0, 5, 1).to_msg())
        b.send(asks(1, 5, 1).to_msg())
        await asyncio.gather(answers(a), answers(b))
        b.writer.close()  # the node's connection closes: every rank it spoke for is gone
        got = await answers(a)
        # The abort comes with the next epoch, formed from the members still heard (pushed epochs).
        assert {m["op"] for m in got.msgs} == {"epoch"} and len(got.to) == RANKS
        assert {m["abort"] for m in got.msgs} == {1}
        assert {m["decision"]["epoch"] for m in got.msgs} == {2}
        assert all(list(QuorumDecision.from_json(m["decision"]).members) == [0] for m in got.msgs)
        assert 1 not in c.replicas and 1 not in c.quorum.alive

    run(tmp_path, scenario, total_replicas=2, min_replicas=1)


def test_a_node_speaks_only_for_its_own_ranks(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a = await node(c, "a", 0)
        other = await member(c, SECRET, 1)  # replica 1 on its own connection
        # Replica 1's request through node a is not acted on: a is told it does not hold that rank.
        a.send(asks(1, 5, 1).to_msg())
        got = await answers(a)
        assert got.msgs == () and set(got.dropped) == {(1, k) for k in range(RANKS)}
        assert c.pending == {}
        # A rank that is connected already is refused alone; the node's connection stays.
        a.send(protocol.NodeHello(node="a", ranks=(protocol.Hello(replica=1, rank=0, world_size=1),)).to_msg())
        got = await answers(a)
        assert got.dropped == ((1, 0),) and got.msgs[0]["op"] == "error"
        assert c.replicas[1][0].link is not None and len(c.replicas[0]) == RANKS
        # Speaking for another node's name is a malformed line, skipped.
        a.send(hello("b", 2).to_msg())
        assert (await next_op(a, "error"))["message"].startswith("malformed")
        # A rank the agent saw exit leaves alone: its replica is evicted, the node stays.
        a.send(protocol.NodeLeave(ranks=((0, 1),)).to_msg())
        got = await answers(a)
        assert set(got.dropped) == {(0, k) for k in range(RANKS) if k != 1}
        assert 0 not in c.replicas
        other.writer.close()

    run(tmp_path, scenario, total_replicas=3, min_replicas=1)


def test_node_messages_are_bounded_and_validated() -> None:
    too_many = {"node": "n", "ranks": [{"replica": 0, "rank": k, "world_size": 1} for k in range(MAX_NODE_RANKS + 1)]}
    with pytest.raises(ValueError, match="ranks"):
        protocol.NodeHello.from_msg(too_many)
    with pytest.raises(ValueError, match="replica"):
        protocol.NodeQuorum.from_msg({"asks": [[-1, 0, {"id": 1, "step": 0}]]})
    with pytest.raises(ValueError, match="as many"):
        protocol.NodeAnswers.from_msg({"to": [[0, 0]], "msgs": []})


def test_answers_too_long_for_one_line_are_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's answers never make a line the agent's reader refuses (its limit is MAX_LINE)."""
    sent: list[bytes] = []

    class Link:
        def send_payload(self, payload: bytes) -> None:
            sent.append(payload)

    n = NodeConn("n", Link())  # type: ignore[arg-type]
    body = b'{"op":"abort","epoch":1,"pad":"' + b"x" * (protocol.MAX_LINE // 5) + b'"}'
    n.outbox = [(slot_json((0, k)), body) for k in range(8)]
    n.flush()
    assert len(sent) > 1 and all(len(p) < protocol.MAX_LINE for p in sent)
    total = [protocol.NodeAnswers.from_msg(__import__("json").loads(p)) for p in sent]
    assert sum(len(t.to) for t in total) == 8
    assert answers_payload([], [(0, 1)]) == b'{"op":"node_answers","to":[],"msgs":[],"dropped":[[0,1]]}'


def test_a_node_relays_its_ranks_goodbyes_compute_times_and_is_counted_in_status(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a = await node(c, "a", 0)
        assert c.status()["nodes"] == {"a": RANKS}
        beats = tuple((0, k, 3, 0.5 + k) for k in range(RANKS))
        a.send(protocol.NodeHeartbeat(beats=beats).to_msg())
        # A rank's own message, as its connection would say it; a malformed one is its own error.
        a.send(protocol.NodeSay(says=((0, 0, {"op": "bye"}), (0, 1, {"op": "exited", "replica": 5}))).to_msg())
        got = await answers(a)
        assert got.to == ((0, 1),) and got.msgs[0]["op"] == "error" and "replica 0" in got.msgs[0]["message"]
        assert c.replicas[0][0].finished and not c.replicas[0][1].finished
        assert [c.replicas[0][k].compute_s for k in range(RANKS)] == [0.5 + k for k in range(RANKS)]
        assert c.status()["replicas"][0]["compute_s"] == 0.5 + RANKS - 1
        # What else a rank says is not relayed through node_say (quorum asks have their own line).
        with pytest.raises(ValueError, match="node_say"):
            protocol.NodeSay.from_msg({"says": [[0, 0, {"op": "quorum", "id": 1, "step": 1}]]})
        a.writer.close()
        await asyncio.sleep(0.2)
        assert c.status()["nodes"] == {}

    run(tmp_path, scenario, total_replicas=2, min_replicas=1)


def test_past_its_request_budget_the_coordinator_grants_steps_and_a_newcomer_waits_them_out(tmp_path: Path) -> None:
    async def step(links: list[protocol.Link], replicas: list[int], step: int, req_id: int) -> list[list[Any]]:
        """Each node's answers to its ranks' requests for ``step`` (what else comes is skipped)."""
        for link, r in zip(links, replicas, strict=True):
            link.send(asks(r, step, req_id).to_msg())
        return list(await asyncio.gather(*(quorum_answers(link) for link in links)))

    async def quorum_answers(link: protocol.Link) -> list[Any]:
        while True:  # alive while an epoch forms, a donor told of a newcomer
            got = [m for m in (await answers(link)).msgs if m["op"] == "quorum"]
            if got:
                assert len(got) == RANKS
                return got

    async def scenario(c: Coordinator) -> None:
        a, b = await node(c, "a", 0), await node(c, "b", 1)
        await step([a, b], [0, 1], 0, 1)
        throughs: dict[int, int] = {}
        for s in range(1, 12):  # the coordinator learns the step time, then grants
            await asyncio.sleep(0.01)
            for got, r in zip(await step([a, b], [0, 1], s, s + 1), [0, 1], strict=True):
                assert {m["same_epoch"] for m in got} == {1} and len({m.get("through") for m in got}) == 1
                if got[0].get("through") is not None:
                    throughs[r] = got[0]["through"]
        assert throughs and c.requests.granted > 0 and c.status()["granted"] == c.requests.granted
        granted = c.quorum.granted_through
        assert granted == max(throughs.values()) > 11
        n = await node(c, "c", 2)  # a newcomer, back from step 0
        n.send(asks(2, 0, 1).to_msg())
        for s in range(12, granted + 1):  # the granted steps stand: same members, no further grant
            for got in await step([a, b], [0, 1], s, s + 1):
                assert {m["same_epoch"] for m in got} == {1} and {m.get("through") for m in got} == {None}
        for got in [*await step([a, b], [0, 1], granted + 1, granted + 2), await quorum_answers(n)]:
            d = QuorumDecision.from_json(got[0]["decision"])
            assert (d.epoch, d.step, d.members, d.behind) == (2, granted + 1, (0, 1, 2), (2,))

    run(tmp_path, scenario, total_replicas=3, min_replicas=1, max_asks_per_s=0.5, startup_window_s=0.2)


def test_a_rank_of_its_own_connection_is_never_granted(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        links = [await member(c, SECRET, r) for r in (0, 1)]
        for s in range(12):
            await asyncio.sleep(0.01)
            for link in links:
                link.send(protocol.QuorumAsk(id=s + 1, step=s, step_time=None, failed_epoch=None).to_msg())
            for link in links:
                got = await next_op(link, "quorum")
                assert "through" not in got
        assert c.requests.granted == 0

    run(tmp_path, scenario, total_replicas=2, min_replicas=1, max_asks_per_s=0.5)


def test_a_text_told_to_a_nodes_ranks_alike_goes_once_and_reaches_each() -> None:
    """An epoch pushed after a death is the same text for every rank of a node: it goes once
    with the count of ranks it is for, and the node's agent still hands each rank its message."""
    push = b'{"op":"epoch","abort":4,"decision":{"epoch":5,"step":9}}'
    alone = b'{"op":"abort","epoch":4}'
    batch = [(slot_json((3, k)), push) for k in range(6)] + [(slot_json((3, 6)), alone), (slot_json((3, 7)), push)]
    payload = answers_payload(batch, [(3, 9)])
    assert payload.count(b'"decision"') == 2 and b'"runs":[6,1,1]' in payload
    got = protocol.NodeAnswers.from_msg(json.loads(payload))
    assert got.to == tuple((3, k) for k in range(8)) and got.dropped == ((3, 9),)
    assert [m["op"] for m in got.msgs] == ["epoch"] * 6 + ["abort", "epoch"]
    assert got.msgs[0] == json.loads(push) and got.msgs[7] == json.loads(push)
    # Texts that differ (each rank's own answer) go as before, one each, without runs.
    own = [(slot_json((3, k)), b'{"op":"abort","epoch":%d}' % k) for k in range(3)]
    assert b'"runs"' not in answers_payload(own, [])


@pytest.mark.parametrize(
    "runs", [[1], [2, 2], [0, 3], [3, "1"], "3", [1.0, 2]], ids=["short", "long", "zero", "text", "not-list", "float"]
)
def test_runs_that_do_not_add_up_to_the_ranks_are_refused(runs: object) -> None:
    msg = {"to": [[0, 0], [0, 1], [0, 2]], "msgs": [{"op": "abort", "epoch": 1}, {"op": "abort", "epoch": 2}]}
    with pytest.raises(ValueError, match="runs|as many"):
        protocol.NodeAnswers.from_msg({**msg, "runs": runs})


def test_each_group_meets_on_its_leader_node_s_store_and_the_leader_turns_with_the_epoch(tmp_path: Path) -> None:
    """Rank k of every member is told the store of the node speaking for rank k of the epoch's
    leader (``members[epoch % len(members)]``): one store per group on one of its members' nodes,
    never the coordinator's for relayed ranks. A node that hosts none leaves its groups on the
    coordinator's store; a malformed store refuses the node."""
    stores = {0: "10.0.0.1:7000", 1: "10.0.0.2:7000", 2: ""}

    async def node_with_store(c: Coordinator, replica: int) -> protocol.Link:
        link = await connect(c, SECRET)
        said = protocol.NodeHello(node=f"n{replica}", ranks=hello(f"n{replica}", replica).ranks, store=stores[replica])
        link.send(said.to_msg())
        assert {m["op"] for m in (await answers(link)).msgs} == {"welcome"}
        return link

    async def scenario(c: Coordinator) -> None:
        links = [await node_with_store(c, r) for r in range(3)]
        for r, link in enumerate(links):
            link.send(asks(r, 5, 1).to_msg())
        got = await asyncio.gather(*(answers(link) for link in links))
        epoch = got[0].msgs[0]["decision"]["epoch"]
        leader = [0, 1, 2][epoch % 3]
        expected = stores[leader] or c.store_address
        for r in range(3):
            assert [m["store"] for m in got[r].msgs] == [expected] * RANKS, (r, epoch)
        # Node 1 dies: the next epoch, pushed, meets on its new leader's store.
        links[1].writer.close()
        pushed = await asyncio.gather(answers(links[0]), answers(links[2]))
        decision = QuorumDecision.from_json(pushed[0].msgs[0]["decision"])
        assert list(decision.members) == [0, 2] and decision.epoch == epoch + 1
        expected = stores[decision.leader] or c.store_address
        for got_ in pushed:
            assert [m["store"] for m in got_.msgs] == [expected] * RANKS
        # A store that is no HOST:PORT refuses the node that says it.
        bad = await connect(c, SECRET)
        one = (protocol.Hello(replica=1, rank=0, world_size=RANKS, node="n9"),)
        bad.send({**protocol.NodeHello(node="n9", ranks=one).to_msg(), "store": "no-port"})
        assert "store must look like HOST:PORT" in (await next_op(bad, "error"))["message"]

    run(tmp_path, scenario, total_replicas=3, min_replicas=1)


def test_a_node_hello_says_its_store_only_when_it_hosts_one() -> None:
    ranks = (protocol.Hello(replica=0, rank=0, world_size=1, node="a"),)
    plain = protocol.NodeHello(node="a", ranks=ranks)
    assert "store" not in plain.to_msg() and protocol.NodeHello.from_msg(plain.to_msg()) == plain
    hosting = protocol.NodeHello(node="a", ranks=ranks, store="10.1.2.3:4567")
    assert protocol.NodeHello.from_msg(hosting.to_msg()) == hosting
    for bad in ("host", "host:0", "host:70000", ":80", "h:８0", "x" * 300 + ":1", 5):
        with pytest.raises(ValueError, match="store"):
            protocol.NodeHello.from_msg({**plain.to_msg(), "store": bad})


@pytest.mark.parametrize(
    ("store", "coordinator", "used"),
    [
        ("10.0.0.7:4100", "10.0.0.1", "10.0.0.7:4100"),  # a routable store: used
        ("node7:4100", "0.0.0.0", "node7:4100"),  # a host name: resolved as every other address is
        ("127.0.0.1:4100", "10.0.0.1", ""),  # an agent that reached the coordinator through loopback
        ("127.0.1.1:4100", "0.0.0.0", ""),  # (a Debian host name) while the coordinator serves every node
        ("localhost:4100", "10.0.0.1", ""),
        ("0.0.0.0:4100", "10.0.0.1", ""),
        ("[::1]:4100", "::", ""),
        ("127.0.0.1:4100", "127.0.0.1", "127.0.0.1:4100"),  # the whole job on one machine
        ("127.0.0.1:4100", "localhost", "127.0.0.1:4100"),
    ],
)
def test_a_store_other_nodes_cannot_dial_is_not_used(store: str, coordinator: str, used: str) -> None:
    assert usable_store(store, coordinator) == used


def test_a_node_s_hellos_are_registered_by_replica_and_each_rank_refused_alone(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a = await node(c, "a", 0)
        ranks = (
            protocol.Hello(replica=1, rank=0, world_size=2, node="a"),
            protocol.Hello(replica=1, rank=0, world_size=2, node="a"),  # said twice in one run: refused
            protocol.Hello(replica=1, rank=5, world_size=2, node="a"),  # not below its world size
            protocol.Hello(replica=7, rank=0, world_size=1, node="a"),  # no replica of this job
            protocol.Hello(replica=1, rank=1, world_size=2, node="a"),
        )
        a.send(protocol.NodeHello(node="a", ranks=ranks).to_msg())
        got = await answers(a)
        told = dict(zip(got.to, (m["op"] for m in got.msgs), strict=True))
        assert got.to.count((1, 0)) == 2 and told[(1, 1)] == "welcome"
        assert [m["op"] for m in got.msgs] == ["welcome", "error", "error", "error", "welcome"]
        assert "already connected" in got.msgs[1]["message"] and "not below world_size" in got.msgs[2]["message"]
        assert "not one of this job's" in got.msgs[3]["message"]
        assert set(got.dropped) == {(1, 5), (7, 0)}  # not (1, 0): its first hello holds it
        assert set(c.replicas[1]) == {0, 1} and 7 not in c.replicas
        assert set(c.nodes.status().values()) == {RANKS + 2}  # node a still speaks for (1, 0)
        assert 1 in c.quorum.alive  # every rank of replica 1 is in: it is connected

    run(tmp_path, scenario, total_replicas=3, min_replicas=1)


def test_hellos_run_by_replica_world_size_and_epoch() -> None:
    def h(replica: int, rank: int, world_size: int = 2, epoch: int | None = 3) -> protocol.Hello:
        return protocol.Hello(replica=replica, rank=rank, world_size=world_size, epoch=epoch)

    hellos = [h(0, 0), h(0, 1), h(1, 0), h(1, 1, epoch=None), h(1, 0, world_size=3), h(0, 0)]
    assert [[(x.replica, x.rank) for x in run] for run in hello_runs(hellos)] == [
        [(0, 0), (0, 1)],
        [(1, 0)],
        [(1, 1)],
        [(1, 0)],
        [(0, 0)],
    ]
    assert hello_runs([]) == []


def test_a_replica_whose_every_rank_is_refused_leaves_no_trace(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a = await node(c, "a", 0)
        planned = c._planned_for
        a.send(protocol.NodeHello(node="a", ranks=(protocol.Hello(replica=2, rank=5, world_size=2),)).to_msg())
        got = await answers(a)
        assert got.dropped == ((2, 5),) and got.msgs[0]["op"] == "error"
        assert 2 not in c.replicas and c._planned_for == planned  # no entry, and no heartbeat plan for its size

    run(tmp_path, scenario, total_replicas=3, min_replicas=1)


def test_a_node_s_ranks_claim_the_resumed_epoch_together(tmp_path: Path) -> None:
    history = StateStore(tmp_path)
    history.record_epoch(5, 40, [0, 1], [])
    history.flush()
    history.close()

    async def scenario(c: Coordinator) -> None:
        assert c.resumed is not None
        a = await connect(c, SECRET)
        said = tuple(
            protocol.Hello(replica=0, rank=k, world_size=RANKS, node="a", step=40, epoch=5) for k in range(RANKS)
        )
        a.send(protocol.NodeHello(node="a", ranks=said).to_msg())
        got = await answers(a)
        assert [m["op"] for m in got.msgs] == ["welcome"] * RANKS
        assert [conn.trains for conn in c.replicas[0].values()] == [5] * RANKS  # every rank, not only the last
        assert c.resumed is not None and c.resumed.state.back == {0}  # replica 1 is not back yet

    run(tmp_path, scenario, total_replicas=2, min_replicas=1)


def test_one_live_connection_speaks_for_a_node_name(tmp_path: Path) -> None:
    """A second connection under a live node's name is refused (it could have spoken for that
    node's ranks as they reconnect); once the first is gone, the name is free again."""

    async def scenario(c: Coordinator) -> None:
        a = await node(c, "a", 0)
        impostor = await connect(c, SECRET)
        impostor.send(hello("a", 1).to_msg())
        refusal = (await next_op(impostor, "error"))["message"]
        assert "node 'a' is spoken for by another live connection" in refusal
        assert await closed(impostor)
        assert 1 not in c.replicas and set(c.nodes.by_node) == {"a"}
        a.send(asks(0, 5, 1).to_msg())  # the node's own connection is served as before
        assert (await answers(a)).to == tuple((0, k) for k in range(RANKS))
        a.writer.close()
        for _ in range(100):
            if "a" not in c.nodes.by_node:
                break
            await asyncio.sleep(0.02)
        again = await node(c, "a", 1)  # its agent reconnected: served
        again.writer.close()

    run(tmp_path, scenario, total_replicas=2, min_replicas=1)


def test_a_node_may_claim_only_the_ranks_placed_on_it(tmp_path: Path) -> None:
    """With node agents, a node connection saying hello for a replica placed on another node is
    refused, rank by rank; the node it is placed on registers it."""

    async def scenario(c: Coordinator) -> None:
        agents = {}
        for name in ("a", "b"):
            agents[name] = await connect(c, SECRET)
            agents[name].send(protocol.AgentHello(node=name, slots=1).to_msg())
            agents[name] = (agents[name], (await next_op(agents[name], "assign"))["replicas"])
        assert agents["a"][1] == [0] and agents["b"][1] == [1]
        b = await connect(c, SECRET)
        b.send(hello("b", 0).to_msg())  # replica 0 is a's
        got = await answers(b)
        assert set(got.dropped) == {(0, k) for k in range(RANKS)}
        assert {m["op"] for m in got.msgs} == {"error"}
        assert "replica 0 is placed on node a, not on b" in got.msgs[0]["message"]
        assert 0 not in c.replicas
        b.send(hello("b", 1).to_msg())  # its own replica: registered on the same connection
        got = await answers(b)
        assert [m["op"] for m in got.msgs] == ["welcome"] * RANKS and len(c.replicas[1]) == RANKS
        a = await node(c, "a", 0)
        assert len(c.replicas[0]) == RANKS
        for link in (a, b, agents["a"][0], agents["b"][0]):
            link.writer.close()

    run(tmp_path, scenario, total_replicas=2, min_replicas=1)
