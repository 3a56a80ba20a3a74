"""The relay's bookkeeping for a standby told the node's hello beforehand (issue 31's takeover).

Without sockets: what the standby is told (every rank announced, in the epoch it trains), when it
must be told again, and what a failover onto it says: nothing but the requests that wait when the
standby's copy is current, the node's whole hello and a leave for each rank gone when it is not.
What a user relies on: no rank connection is closed, no request is lost, a grant stands, a goodbye
is not taken for a death, and the epoch a standby resumes is claimed as the ranks train in it.
"""

from __future__ import annotations

from typing import Any

from unbroken.control import protocol
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.launch.node.relay import RankLine, RelayBook


def hello(replica: int, rank: int, epoch: int | None = None) -> protocol.Hello:
    return protocol.Hello(replica=replica, rank=rank, world_size=2, node="ignored", epoch=epoch)


def ask(req_id: int, step: int, failed_epoch: int | None = None) -> dict[str, Any]:
    return protocol.QuorumAsk(id=req_id, step=step, step_time=None, failed_epoch=failed_epoch).to_msg()


def answer(book: RelayBook, slot: tuple[int, int], msg: dict[str, Any]) -> None:
    book.fan_out(protocol.NodeAnswers(to=(slot,), msgs=(msg,)))


def full(req_id: int, epoch: int, step: int) -> dict[str, Any]:
    """A full quorum answer, as the coordinator writes it (only what the relay reads matters here)."""
    return {"op": "quorum", "id": req_id, "decision": {"epoch": epoch, "step": step, "member_runs": [[0, 1]]}}


def push(epoch: int, step: int, abort: int, behind: tuple[int, ...] = ()) -> dict[str, Any]:
    decision = QuorumDecision(epoch=epoch, step=step, members=(0, 1), behind=behind).to_json()
    return protocol.EpochPush(abort=abort, decision=decision, transfer_addrs={}, store="").to_msg()


def announced(*slots: tuple[int, int]) -> tuple[RelayBook, list[RankLine]]:
    book = RelayBook("n1", store="10.0.0.7:4100")
    ranks = [book.hello(f"link{r}.{k}", hello(r, k)) for r, k in slots]
    book.lines()
    return book, ranks


def said_to_standby(book: RelayBook) -> protocol.NodeHello:
    msg = book.standby_hello()
    assert msg is not None and msg["beforehand"] is True
    return protocol.NodeHello.from_msg(msg)


def test_the_standby_is_told_every_rank_announced_at_its_step_and_epoch() -> None:
    book = RelayBook("n1", store="10.0.0.7:4100")
    assert book.standby_hello() is None and book.presaid == {}  # nothing to say yet, but told so
    a = book.hello("la", hello(0, 0))
    book.hello("lb", hello(0, 1, epoch=4))  # said hello, not announced upstream yet: not the standby's
    assert book.standby_hello() is None
    book.lines()
    answer(book, (0, 0), full(1, 5, 9))
    book.said(a, protocol.Heartbeat(step=10, compute_s=None).to_msg())
    told = said_to_standby(book)
    assert told.node == "n1" and told.store == "10.0.0.7:4100"
    assert [(h.replica, h.rank, h.step, h.epoch) for h in told.ranks] == [(0, 0, 10, 5), (0, 1, 0, 4)]
    assert book.presaid == {(0, 0): 5, (0, 1): 4} and not book.stale


def test_the_standby_is_told_again_when_a_rank_comes_goes_or_trains_in_another_epoch() -> None:
    book, (a, b) = announced((0, 0), (0, 1))
    said_to_standby(book)
    answer(book, (0, 0), protocol.Welcome(store="h:1", epoch=0, heartbeat_s=0.4, timeout_s=4.0).to_msg())
    answer(book, (0, 0), protocol.QuorumSame(id=1, same_epoch=0, step=1).to_msg())
    assert book.stale  # None (its hello's) to 0
    said_to_standby(book)
    answer(book, (0, 0), protocol.QuorumSame(id=2, same_epoch=0, step=2).to_msg())
    assert not book.stale  # the same epoch: nothing new for the standby
    answer(book, (0, 1), push(epoch=1, step=2, abort=0))
    assert book.stale
    said_to_standby(book)
    book.gone(b)
    assert book.stale
    said_to_standby(book)
    book.hello("lc", hello(1, 0))
    book.lines()  # announced upstream: the standby hears of it next
    assert book.stale


def test_a_failover_onto_a_standby_told_keeps_every_rank_and_says_only_the_requests_that_wait() -> None:
    book, (a, b) = announced((0, 0), (0, 1))
    answer(book, (0, 0), protocol.QuorumSame(id=1, same_epoch=3, step=5, through=9).to_msg())  # a grant
    answer(book, (0, 1), full(1, 3, 5))
    said_to_standby(book)
    book.said(b, ask(2, 6))  # sent upstream, and the active coordinator died before it answered
    assert [m["op"] for m in book.lines()] == ["node_quorum"]
    waiting = book.failover()
    assert waiting == [b] and list(book.ranks.values()) == [a, b]  # no rank connection closed
    lines = book.lines()
    assert [m["op"] for m in lines] == ["node_quorum"]  # no hello: the standby was told
    assert [(r, k, q.id, q.step) for r, k, q in protocol.NodeQuorum.from_msg(lines[0]).asks] == [(0, 1, 2, 6)]
    assert book.said(a, ask(2, 6)) is not None  # its grant stands (the standby admits no newcomer meanwhile)
    answer(book, (0, 1), full(2, 3, 6))  # answered by the standby: nothing waits any more
    assert b.pending is None and book.lines() == []
    assert book.presaid is None  # the standby serves now: the next one is told anew


def test_a_failover_says_what_the_standby_was_not_told_before_the_requests() -> None:
    book, (a, b) = announced((0, 0), (0, 1))
    said_to_standby(book)
    book.gone(b)  # its leave went to the coordinator that died
    late = book.hello("lc", hello(1, 0))  # its hello is queued, not sent
    answer(book, (0, 0), push(epoch=4, step=7, abort=3))  # the epoch changed: the standby's claim is stale
    book.said(late, ask(1, 7))
    book.failover()
    lines = book.lines()
    assert [m["op"] for m in lines] == ["node_hello", "node_leave", "node_quorum"]
    whole = protocol.NodeHello.from_msg(lines[0])  # said beforehand: it replaces the standby's copy
    assert whole.beforehand and [(h.replica, h.rank, h.epoch) for h in whole.ranks] == [(0, 0, 4), (1, 0, None)]
    assert protocol.NodeLeave.from_msg(lines[1]).ranks == ((0, 1),)
    assert [(r, k) for r, k, _ in protocol.NodeQuorum.from_msg(lines[2]).asks] == [(1, 0)]
    assert late.announced and book.lines() == []


def test_a_request_answered_by_a_pushed_epoch_is_not_said_again_and_one_still_waiting_is() -> None:
    book, (a, b) = announced((0, 0), (0, 1))
    said_to_standby(book)
    book.said(a, ask(1, 5, failed_epoch=2))  # its exchange failed: the push for step 5 answers it
    book.said(b, ask(1, 4))  # the push is for step 5, and b is not behind in it: not this request's answer
    book.lines()
    for slot in ((0, 0), (0, 1)):
        answer(book, slot, push(epoch=3, step=5, abort=2))
    assert a.pending is None and b.pending is not None
    assert book.failover() == [b]


def test_without_a_standby_told_a_failover_is_refused_by_the_book_s_state() -> None:
    book, _ = announced((0, 0))
    assert book.presaid is None  # never told: the relay closes its rank connections (reset) instead
    said_to_standby(book)
    book.reset()
    assert book.presaid is None and book.ranks == {}


def test_a_goodbye_said_before_the_failover_goes_before_its_rank_s_leave() -> None:
    book, (a, b) = announced((0, 0), (0, 1))
    said_to_standby(book)
    book.said(b, protocol.Bye().to_msg())
    book.gone(b)  # said goodbye and closed in the turn the node connection was lost
    book.failover()
    lines = book.lines()
    assert [m["op"] for m in lines] == ["node_hello", "node_say", "node_leave"]  # finished, then gone: no eviction
    assert protocol.NodeSay.from_msg(lines[1]).says == ((0, 1, {"op": "bye"}),)


def test_a_welcome_of_an_older_term_is_refused_and_passed_on_to_no_rank() -> None:
    import pytest

    from unbroken.control.client import StaleTerm

    book, _ = announced((0, 0))
    welcome = protocol.Welcome(store="s:1", epoch=3, heartbeat_s=None, timeout_s=None, term=4).to_msg()
    out, _ = book.fan_out(protocol.NodeAnswers(to=((0, 0),), msgs=(welcome,)))
    assert [m["term"] for _, m in out] == [4] and book.term == 4
    stale = protocol.Welcome(store="s:1", epoch=3, heartbeat_s=None, timeout_s=None, term=3).to_msg()
    with pytest.raises(StaleTerm, match="older than term 4"):
        book.fan_out(protocol.NodeAnswers(to=((0, 0),), msgs=(stale,)))
