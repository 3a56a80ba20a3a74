"""Frames: a size announced by the peer is checked before anything is allocated."""

from __future__ import annotations

import socket
import struct

import pytest

from unbroken.wire.framing import FrameError, recv_exact, recv_frame, send_frame


def test_frames_round_trip_and_an_oversized_announcement_is_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, b"hello")
        assert recv_frame(b, 16) == b"hello"
        a.sendall(struct.pack("!Q", 1 << 40))
        with pytest.raises(FrameError, match="at most 16"):
            recv_frame(b, 16)


def test_a_peer_that_closes_mid_frame_is_an_error_not_a_short_read() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(b"abc")
        a.close()
        with pytest.raises(FrameError, match="after 3 of 8"):
            recv_exact(b, 8)
