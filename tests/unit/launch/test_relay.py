"""The relay's bookkeeping, without sockets: what goes up the node connection, what comes down.

A node's ranks are many connections to the relay and one to the coordinator: what is checked is
that each turn's requests share one line (in the order they were said), that heartbeats vouch
only for ranks heard, that answers reach the rank they are for and no other, and that a rank
connection speaks for the slot it said hello as and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from unbroken.control import protocol
from unbroken.control.protocol.messages import MAX_NODE_RANKS
from unbroken.diagnosis.telemetry import TelemetryBatch
from unbroken.launch.node.relay import MAX_SAY_BYTES, Overloaded, RankLine, RelayBook


def hello(replica: int, rank: int, world_size: int = 2, step: int = 0) -> protocol.Hello:
    return protocol.Hello(replica=replica, rank=rank, world_size=world_size, node="ignored", step=step)


def ask(req_id: int, step: int) -> dict[str, Any]:
    return protocol.QuorumAsk(id=req_id, step=step, step_time=None, failed_epoch=None).to_msg()


def book_with(*slots: tuple[int, int]) -> tuple[RelayBook, list[RankLine]]:
    """A book whose ranks at ``slots`` said hello, and were announced upstream."""
    book = RelayBook("n1")
    ranks = [book.hello(f"link{r}.{k}", hello(r, k)) for r, k in slots]
    book.lines()
    return book, ranks


def test_the_hellos_and_requests_of_one_turn_share_a_line_each_in_order() -> None:
    book = RelayBook("n1")
    a, b = book.hello("la", hello(0, 0, step=4)), book.hello("lb", hello(0, 1))
    book.said(a, ask(1, 5))
    book.said(b, ask(1, 5))
    assert book.urgent
    lines = book.lines()
    assert [m["op"] for m in lines] == ["node_hello", "node_quorum"]
    said = protocol.NodeHello.from_msg(lines[0])
    assert said.node == "n1" and [(h.replica, h.rank, h.step, h.node) for h in said.ranks] == [
        (0, 0, 4, "n1"),  # the agent's node name, whatever the rank said
        (0, 1, 0, "n1"),
    ]
    asks = protocol.NodeQuorum.from_msg(lines[1]).asks
    assert [(r, k, q.id, q.step) for r, k, q in asks] == [(0, 0, 1, 5), (0, 1, 1, 5)]
    assert book.lines() == [] and not book.urgent
    # A request alone in its turn waits for nobody: it is its own line.
    book.said(a, ask(2, 6))
    assert [m["op"] for m in book.lines()] == ["node_quorum"]


def test_every_node_hello_says_the_store_the_agent_hosts() -> None:
    book = RelayBook("n1", store="10.0.0.7:4100")
    book.hello("la", hello(0, 0))
    first = protocol.NodeHello.from_msg(book.lines()[0])
    book.hello("lb", hello(0, 1))  # a rank announced later: its line says the store too
    later = protocol.NodeHello.from_msg(book.lines()[0])
    assert first.store == later.store == "10.0.0.7:4100"
    plain = RelayBook("n2")  # an agent hosting no store (its ranks' groups meet on the coordinator's)
    plain.hello("lc", hello(0, 0))
    assert "store" not in plain.lines()[0]


def test_a_rank_that_reconnects_in_the_same_turn_leaves_before_it_says_hello_again() -> None:
    book, (a,) = book_with((0, 0))
    book.gone(a)
    again = book.hello("l2", hello(0, 0))
    book.said(again, ask(3, 7))
    assert [m["op"] for m in book.lines()] == ["node_leave", "node_hello", "node_quorum"]


def test_a_rank_gone_before_its_hello_left_costs_the_coordinator_nothing() -> None:
    book = RelayBook("n1")
    a = book.hello("la", hello(0, 0))
    book.said(a, ask(1, 1))
    book.gone(a)
    assert book.lines() == [] and book.ranks == {}


def test_a_goodbye_said_as_the_connection_closes_goes_before_its_leave() -> None:
    book, (a,) = book_with((0, 0))
    book.said(a, protocol.Bye().to_msg())
    book.gone(a)
    lines = book.lines()
    assert [m["op"] for m in lines] == ["node_say", "node_leave"]
    assert protocol.NodeSay.from_msg(lines[0]).says == ((0, 0, {"op": "bye"}),)


def test_heartbeats_vouch_only_for_ranks_heard_and_not_mentioned_since() -> None:
    book, (a, b, c) = book_with((0, 0), (0, 1), (1, 0))
    assert protocol.NodeHeartbeat.from_msg(book.beats() or {}).beats == (
        (0, 0, 0, None),  # heard at its hello, which the coordinator heard of as a hello alone
        (0, 1, 0, None),
        (1, 0, 0, None),
    )
    assert book.beats() is None  # nothing heard since: a hung rank is not kept alive by its node
    book.said(a, protocol.Heartbeat(step=7, compute_s=0.25).to_msg())
    book.said(b, protocol.Heartbeat(step=7, compute_s=None).to_msg())
    book.said(b, ask(1, 8))
    book.lines()  # b's request tells the coordinator b is alive: no beat needed for it
    assert protocol.NodeHeartbeat.from_msg(book.beats() or {}).beats == ((0, 0, 7, 0.25),)
    assert not book.urgent  # a heartbeat alone sends nothing before the tick


def test_telemetry_rides_with_the_next_line_and_long_runs_are_split() -> None:
    book, (a, b) = book_with((0, 0), (0, 1))
    batch = TelemetryBatch(now_ns=5, memory=1e6).to_msg()
    book.said(a, protocol.Telemetry(protocol.Heartbeat(step=3, compute_s=0.1), batch).to_msg())
    assert not book.urgent  # a flight-recorder batch waits for a line that goes anyway
    book.said(b, ask(1, 4))
    lines = book.lines()
    assert [m["op"] for m in lines] == ["node_say", "node_quorum"]
    ((r, k, said),) = protocol.NodeSay.from_msg(lines[0]).says
    assert (r, k, said["op"], said["step"], said["memory"]) == (0, 0, "telemetry", 3, 1e6)
    # Many batches of one turn: split before a line nears the coordinator's limit.
    big = TelemetryBatch(now_ns=5, memory=1.0).to_msg() | {"pad": "x" * (MAX_SAY_BYTES // 3)}
    for _ in range(4):
        book._put("say", a, {"op": "telemetry", **big})
    assert [m["op"] for m in book.lines()] == ["node_say", "node_say"]


def test_answers_go_to_the_rank_they_are_for_and_a_welcome_sets_the_pace() -> None:
    book, (a, b) = book_with((0, 0), (0, 1))
    late = book.hello("lc", hello(1, 0))  # its hello not sent yet: nothing can be for it
    welcome = protocol.Welcome(store="h:1", epoch=0, heartbeat_s=0.4, timeout_s=4.0).to_msg()
    answers = protocol.NodeAnswers(
        to=((0, 1), (0, 0), (3, 3), (1, 0)),
        msgs=(welcome, {"op": "abort", "epoch": 2}, {"op": "abort", "epoch": 9}, {"op": "abort", "epoch": 9}),
    )
    out, dropped = book.fan_out(answers)
    assert [(r, m["op"]) for r, m in out] == [(b, "welcome"), (a, "abort")]  # unchanged, to each its own
    assert out[0][1] is welcome and dropped == [] and book.heartbeat_s == 0.4
    assert late in book.ranks.values()


def test_a_dropped_rank_is_forgotten_and_says_no_leave() -> None:
    book, (a, b) = book_with((0, 0), (0, 1))
    book.said(a, ask(1, 1))
    out, dropped = book.fan_out(
        protocol.NodeAnswers(to=((0, 0),), msgs=({"op": "error", "message": "no"},), dropped=((0, 0),))
    )
    assert [m["op"] for _, m in out] == ["error"] and dropped == [a]
    assert list(book.ranks.values()) == [b]
    book.gone(a)  # its connection, closed by the relay, ends: the coordinator forgot it already
    assert book.lines() == []


def test_a_rank_connection_speaks_for_its_own_slot_only() -> None:
    book, (a,) = book_with((0, 0))
    with pytest.raises(ValueError, match="already connected"):
        book.hello("other", hello(0, 0))  # another connection claiming a live slot
    with pytest.raises(ValueError, match="said hello already"):
        book.said(a, hello(1, 0).to_msg())
    with pytest.raises(ValueError, match="only its own exit"):
        book.said(a, protocol.Exited(replica=1, exitcode=1).to_msg())
    with pytest.raises(ValueError, match="no 'node_quorum'"):
        book.said(a, protocol.NodeQuorum(asks=((1, 0, protocol.QuorumAsk.from_msg(ask(1, 1))),)).to_msg())
    with pytest.raises(ValueError, match="step"):
        book.said(a, {"op": "quorum", "id": 1, "step": -1})
    assert book.lines() == []
    book.said(a, protocol.Exited(replica=0, exitcode=3).to_msg())
    assert protocol.NodeSay.from_msg(book.lines()[0]).says == (
        (0, 0, {"op": "exited", "replica": 0, "exitcode": 3, "incarnation": 0}),
    )


def test_what_waits_for_the_coordinator_is_bounded() -> None:
    book = RelayBook("n1", max_ranks=2, max_queued=4)
    a = book.hello("la", hello(0, 0))
    book.hello("lb", hello(0, 1))
    with pytest.raises(ValueError, match="at most 2 ranks"):
        book.hello("lc", hello(1, 0))
    book.said(a, ask(1, 1))
    book.said(a, ask(2, 2))
    with pytest.raises(Overloaded):
        book.said(a, ask(3, 3))
    assert RelayBook("n").max_ranks == MAX_NODE_RANKS


def test_a_lost_node_connection_closes_every_rank_and_sends_nothing_queued() -> None:
    book, ranks = book_with((0, 0), (0, 1))
    book.said(ranks[0], ask(1, 1))
    assert book.reset() == ranks
    assert book.ranks == {} and book.lines() == [] and book.beats() is None


def answer(book: RelayBook, slot: tuple[int, int], msg: dict[str, Any]) -> None:
    book.fan_out(protocol.NodeAnswers(to=(slot,), msgs=(msg,)))


def test_a_grant_answers_the_steps_it_covers_here_and_nothing_else() -> None:
    book, (a,) = book_with((0, 0))
    answer(book, (0, 0), protocol.QuorumSame(id=1, same_epoch=3, step=5, through=7).to_msg())
    for req_id, step in ((2, 6), (3, 7)):
        got = book.said(a, ask(req_id, step))
        assert got is not None and protocol.QuorumSame.from_msg(json.loads(got)) == protocol.QuorumSame(
            id=req_id, same_epoch=3, step=step
        )
    assert book.lines() == [] and book.answered == 2
    assert book.beats() == protocol.NodeHeartbeat(beats=((0, 0, 7, None),)).to_msg()  # the coordinator hears its step
    assert book.said(a, ask(4, 8)) is None  # past the grant: the coordinator's
    assert [m["op"] for m in book.lines()] == ["node_quorum"]
    assert book.said(a, ask(5, 8)) is None  # and the grant is spent


def test_a_failure_the_same_step_again_or_an_abort_goes_to_the_coordinator() -> None:
    book, (a,) = book_with((0, 0))
    answer(book, (0, 0), protocol.QuorumSame(id=1, same_epoch=3, step=5, through=9).to_msg())
    failed = protocol.QuorumAsk(id=2, step=6, step_time=None, failed_epoch=3).to_msg()
    assert book.said(a, failed) is None  # an exchange that failed is never answered here
    answer(book, (0, 0), protocol.QuorumSame(id=2, same_epoch=3, step=6, through=9).to_msg())
    assert book.said(a, ask(3, 6)) is None  # a step answered already is asked again upstream
    answer(book, (0, 0), protocol.QuorumSame(id=3, same_epoch=3, step=6, through=9).to_msg())
    answer(book, (0, 0), protocol.Abort(epoch=3).to_msg())
    assert book.said(a, ask(4, 7)) is None
    answer(book, (0, 0), protocol.QuorumSame(id=4, same_epoch=3, step=7).to_msg())  # no through: no grant
    assert book.said(a, ask(5, 8)) is None
    assert book.answered == 0


def test_a_grant_is_the_rank_connection_s_alone() -> None:
    book, (a, b) = book_with((0, 0), (0, 1))
    answer(book, (0, 0), protocol.QuorumSame(id=1, same_epoch=3, step=5, through=7).to_msg())
    assert book.said(b, ask(2, 6)) is None
    book.gone(a)
    again = book.hello("la2", hello(0, 0))
    assert book.said(again, ask(2, 6)) is None  # a new connection starts without one
