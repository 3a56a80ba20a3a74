"""Exact reads and length-prefixed frames with a size bound, for the blocking-socket listeners.

A length read from the network is a claim, not a fact: every frame has a caller-given maximum,
checked before anything is allocated, so a peer cannot make a listener reserve gigabytes by
sending eight bytes.
"""

from __future__ import annotations

import socket
import struct

from unbroken.wire.auth import TAG_BYTES, Session

_LEN = struct.Struct("!Q")


class FrameError(ConnectionError):
    """The peer closed the connection mid-frame or announced a frame over the bound."""


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Reads exactly ``n`` bytes; FrameError if the peer closes first."""
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return buf


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the socket; FrameError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n


def send_frame(sock: socket.socket, payload: bytes | bytearray | memoryview) -> None:
    """Sends one frame: an 8-byte big-endian length, then the payload."""
    sock.sendall(_LEN.pack(len(payload)) + bytes(payload))


def recv_frame(sock: socket.socket, max_bytes: int) -> bytearray:
    """Reads one frame of at most ``max_bytes``; FrameError on a larger announcement."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > max_bytes:
        raise FrameError(f"the peer announced a {n}-byte frame; at most {max_bytes} are accepted")
    return recv_exact(sock, n)


def send_sealed(sock: socket.socket, session: Session, payload: bytes) -> None:
    """Sends ``payload`` as one frame with the session's MAC of it appended."""
    send_frame(sock, payload + session.tag(payload))


def recv_sealed(sock: socket.socket, session: Session, max_bytes: int) -> bytes:
    """Reads one frame sent by :func:`send_sealed` and checks its MAC; AuthError if it fails."""
    frame = recv_frame(sock, max_bytes + TAG_BYTES)
    if len(frame) < TAG_BYTES:
        session.check(b"", b"")  # advances the sequence and raises, as any bad MAC does
    payload, tag = bytes(frame[:-TAG_BYTES]), bytes(frame[-TAG_BYTES:])
    session.check(payload, tag)
    return payload
