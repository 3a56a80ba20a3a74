"""The control protocol's socket helpers."""

from __future__ import annotations

import json
import socket

import pytest

from unbroken.control import protocol
from unbroken.control.protocol import connected_to_itself, decode, encode
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.wire.auth import AuthError, Session


def test_a_socket_connected_to_its_own_port_is_recognised() -> None:
    # What a reconnect loop can meet when the coordinator is down: TCP simultaneous open with itself.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())
        assert connected_to_itself(s)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as c:
        assert not connected_to_itself(c)


def _pair() -> tuple[Session, Session]:
    a, b = b"a" * 32, b"b" * 32
    return Session(send_key=a, recv_key=b), Session(send_key=b, recv_key=a)


def test_messages_round_trip_sealed() -> None:
    sender, receiver = _pair()
    line = encode({"op": "hello", "step": 3}, sender)
    assert decode(line, receiver) == {"op": "hello", "step": 3}


def test_a_line_without_its_mac_or_replayed_is_refused() -> None:
    sender, receiver = _pair()
    line = encode({"op": "bye"}, sender)
    with pytest.raises(AuthError):
        decode(b'{"op":"bye"}\n', receiver)
    sender, receiver = _pair()
    line = encode({"op": "bye"}, sender)
    assert decode(line, receiver) == {"op": "bye"}
    with pytest.raises(AuthError):
        decode(line, receiver)  # the same line again
    forged = line.replace(b"bye", b"bad")
    with pytest.raises(AuthError):
        decode(forged, _pair()[1])


def test_an_authentic_line_that_is_no_message_is_a_value_error() -> None:
    sender, receiver = _pair()
    with pytest.raises(ValueError):
        decode(sender.seal_line(b"[1, 2]"), receiver)


def test_a_paired_answer_made_from_the_decisions_head_is_the_answer_made_whole() -> None:
    """A member named in donor pairs gets the decision with its own pairs and its donor's address:
    made from the decision's text encoded once, it must be the very answer encoded whole."""
    decision = QuorumDecision(
        epoch=9, step=41, members=(0, 1, 2, 5, 6), behind=(2, 6), donors=((2, 0), (6, 1))
    ).to_json()
    head = protocol.decision_head(decision)
    for pairs, addrs in (([[2, 0]], {"0": "10.0.0.1:2000"}), ([[6, 1], [7, 1]], {}), ([], {})):
        whole = protocol.answer_tail({**decision, "donors": pairs}, addrs, "10.0.0.9:29500")
        assert protocol.paired_tail(head, pairs, addrs, "10.0.0.9:29500") == whole
        assert json.loads(b"{" + whole)["decision"]["donors"] == pairs
