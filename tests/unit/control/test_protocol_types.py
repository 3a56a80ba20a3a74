"""Typed protocol messages: parsed once at the coordinator's edge with the same bounds as before."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.control import protocol
from unbroken.wire import jsontext


def test_a_hello_parses_into_named_fields_and_keeps_the_bounds() -> None:
    hello = protocol.Hello.from_msg({"op": "hello", "replica": 2, "rank": 1, "world_size": 4, "node": "n0"})
    assert hello == protocol.Hello(replica=2, rank=1, world_size=4, transfer_addr="", node="n0", step=0)
    bounds = ({"replica": True}, {"replica": -1}, {"replica": 1 << 62}, {"node": "x" * 257}, {"step": 1.5})
    # and what the common case's inline checks must refuse as count() and text() do
    inline = ({"epoch": True}, {"epoch": -1}, {"rank": "1"}, {"transfer_addr": 5}, {"transfer_addr": "x" * 257})
    for bad in (*bounds, *inline, {"world_size": 1 << 62}, {"step": -1}, {"node": None}):
        with pytest.raises(ValueError):
            protocol.Hello.from_msg({"op": "hello", "replica": 0, "rank": 0, "world_size": 1, **bad})


def test_a_quorum_ask_and_a_heartbeat_keep_what_was_sent_and_no_more() -> None:
    ask = protocol.QuorumAsk.from_msg({"op": "quorum", "id": 7, "step": 3, "step_time": 0.2, "failed_epoch": 5})
    assert (ask.id, ask.step, ask.step_time, ask.failed_epoch) == (7, 3, 0.2, 5)
    assert protocol.Heartbeat.from_msg({"op": "heartbeat"}) == protocol.Heartbeat(step=None, compute_s=None)
    with pytest.raises(ValueError):
        protocol.QuorumAsk.from_msg({"op": "quorum", "id": 1, "step": 1, "step_time": 1e308})
    with pytest.raises(ValueError):
        protocol.Exited.from_msg({"op": "exited", "replica": 0, "exitcode": 999})
    with pytest.raises(ValueError):
        protocol.AgentHello.from_msg({"op": "agent_hello", "node": "n", "slots": 2, "running": [0, -1]}, 8)
    report = protocol.StackReport.from_msg({"op": "stack", "replica": 0, "rank": 0, "stack": "x" * 20000})
    assert len(report.stack or "") == protocol.MAX_STACK


def test_what_the_coordinator_sends_is_spelt_by_the_types() -> None:
    assert protocol.Abort(epoch=3).to_msg() == {"op": "abort", "epoch": 3}
    assert protocol.Assign(replicas=[1], num_replicas=3).to_msg() == {
        "op": "assign",
        "replicas": [1],
        "num_replicas": 3,
    }
    assert protocol.Error("x" * 600).to_msg()["message"] == "x" * 500
    spares = protocol.Assign(replicas=[3], num_replicas=3, hot_spares=1)
    assert spares.to_msg()["hot_spares"] == 1 and protocol.Assign.from_msg(spares.to_msg()) == spares
    with pytest.raises(ValueError, match="below 3"):
        protocol.Assign.from_msg({"op": "assign", "replicas": [3], "num_replicas": 3})  # a spare's id, no spares
    answer = protocol.QuorumAnswer(id=1, decision={"epoch": 2}, transfer_addrs={"0": "a:1"}, store="s:2").to_msg()
    assert answer == {"op": "quorum", "id": 1, "decision": {"epoch": 2}, "transfer_addrs": {"0": "a:1"}, "store": "s:2"}


def test_a_failed_exchange_reports_its_error_text_within_bounds() -> None:
    msg = {"op": "quorum", "id": 1, "step": 3, "step_time": None, "failed_epoch": 5, "failure": "Unable to find"}
    assert protocol.QuorumAsk.from_msg(msg).failure == "Unable to find"
    assert protocol.QuorumAsk.from_msg({**msg, "failed_epoch": None}).failure is None  # no failed epoch: ignored
    for bad in (7, ["x"], "x" * 2001):
        with pytest.raises(ValueError):
            protocol.QuorumAsk.from_msg({**msg, "failure": bad})


def test_a_quorum_request_leaves_out_what_it_does_not_say_and_reads_back_the_same() -> None:
    plain = protocol.QuorumAsk(id=4, step=9, step_time=None, failed_epoch=None)
    assert plain.to_msg() == {"op": "quorum", "id": 4, "step": 9}
    assert b"null" not in jsontext.dumps(plain.to_msg())  # nothing for jsontext to search for a NaN
    failed = protocol.QuorumAsk(id=5, step=9, step_time=0.5, failed_epoch=3, failure="Connection closed by peer")
    for ask in (plain, failed, dataclasses.replace(failed, failure=None), dataclasses.replace(plain, step_time=2.0)):
        assert protocol.QuorumAsk.from_msg(jsontext.loads(jsontext.dumps(ask.to_msg()))) == ask
    # A node's ranks asking alike share one request's text, and are read back alike.
    alike = tuple((7, k, dataclasses.replace(plain)) for k in range(8))  # equal, as a relay parses them
    node = protocol.NodeQuorum(asks=alike + ((8, 0, failed),))
    msg = node.to_msg()
    assert msg["asks"][0][2] is msg["asks"][7][2] and msg["asks"][8][2] == failed.to_msg()
    assert protocol.NodeQuorum.from_msg(jsontext.loads(jsontext.dumps(msg))) == node


def test_the_job_failed_notice_to_agents_round_trips_and_refuses_bad_codes() -> None:
    notice = protocol.JobFailedNotice(reason="every member failed", exit_code=78)
    assert protocol.JobFailedNotice.from_msg(notice.to_msg()) == notice
    for code in (0, 256, "78", True):
        with pytest.raises(ValueError):
            protocol.JobFailedNotice.from_msg({"op": "job_failed", "reason": "r", "exit_code": code})


def test_a_hello_says_its_epoch_only_when_it_has_one_and_a_node_hello_round_trips() -> None:
    fresh = protocol.Hello(replica=2, rank=1, world_size=8, transfer_addr="10.0.0.2:5000", node="n2", step=40)
    assert "epoch" not in fresh.to_msg()  # as an older coordinator reads it
    trained = dataclasses.replace(fresh, epoch=7)
    assert protocol.Hello.from_msg(trained.to_msg()) == trained
    node = protocol.NodeHello(node="n2", ranks=(fresh, dataclasses.replace(trained, rank=2)))
    assert protocol.NodeHello.from_msg(node.to_msg()) == node
    with pytest.raises(ValueError, match="epoch"):
        protocol.Hello.from_msg({**trained.to_msg(), "epoch": -1})
