"""The coordinator's wire format: one JSON object per line over a persistent TCP connection.

A persistent connection is the point: when a replica process dies, the kernel closes its socket
and the coordinator learns it within milliseconds, with no heartbeat timeout; and the
coordinator can push an abort to a replica blocked in an exchange.

Client -> coordinator ops: ``hello``, ``heartbeat``, ``quorum``, ``bye``, ``exited``.
Coordinator -> client ops: ``welcome``, ``quorum`` (the answer, same ``id``), ``abort``,
``error``.

Node agents (``unbroken agent``) keep a connection of their own: agent -> coordinator
``agent_hello`` (node, slots, pid), ``agent_heartbeat``, ``exited``; coordinator -> agent
``assign`` (replica ids to start), ``agent_status`` (their steps), ``job_finished``, ``error``.
The agent's connection closing means every replica it ran is gone.
"""

from __future__ import annotations

import json
import math
import socket
from typing import Any

Message = dict[str, Any]

MAX_LINE = 1 << 20


def encode(msg: Message) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Message:
    msg = json.loads(line)
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"not a protocol message: {line[:80]!r}")
    return msg


def count(msg: Message, key: str, default: int | None = None) -> int:
    """``msg[key]`` as a non-negative integer (a step, an id, an epoch); ValueError otherwise."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r:.40}")
    return value


def seconds(msg: Message, key: str, default: float | None) -> float | None:
    """``msg[key]`` as a finite, non-negative duration, or None; ValueError otherwise."""
    value = msg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a finite number of seconds >= 0, got {value!r:.40}")
    return float(value)


def connected_to_itself(sock: socket.socket) -> bool:
    """Whether a loopback connect met no listener but its own port (TCP simultaneous open).

    Reconnecting in a loop to a coordinator that is down, with its port in the ephemeral range,
    can pick that very port as the source: the socket then talks to itself, and an endless
    wait on its own hello follows. Such a socket must be closed and the connect retried.
    """
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False
