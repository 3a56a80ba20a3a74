"""The control protocol's socket helpers."""

from __future__ import annotations

import socket

from unbroken.control.protocol import connected_to_itself, decode, encode


def test_a_socket_connected_to_its_own_port_is_recognised() -> None:
    # What a reconnect loop can meet when the coordinator is down: TCP simultaneous open with itself.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())
        assert connected_to_itself(s)
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as c:
        assert not connected_to_itself(c)


def test_messages_round_trip() -> None:
    assert decode(encode({"op": "hello", "step": 3})) == {"op": "hello", "step": 3}
