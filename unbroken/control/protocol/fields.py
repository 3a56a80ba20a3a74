"""The field checks every message of the coordinator's protocol is parsed with, and its bounds.

A peer's line is parsed once, at the receiving edge, into a typed message
(:mod:`unbroken.control.protocol.messages`); each field goes through :func:`count`,
:func:`seconds`, :func:`text` or :func:`address` here (types, bounds, lengths), so a malformed or
hostile value is refused with a ValueError before any handler sees it.
"""

from __future__ import annotations

import math
from typing import Any

from unbroken.config import parse_host_port

Message = dict[str, Any]

MAX_SECONDS = 86400.0  # no duration the job reports (a step, a compute time) is longer than a day
MAX_STACK = 8000  # characters of a stack kept in an event

MAX_FAILURE_CHARS = 2000  # what a rank reports of an error: enough for NCCL's "Last error" line


def count(msg: Message, key: str, default: int | None = None) -> int:
    """``msg[key]`` as a non-negative integer (a step, an id, an epoch); ValueError otherwise."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r:.40}")
    return value


def seconds(msg: Message, key: str, default: float | None) -> float | None:
    """``msg[key]`` as a duration of 0 to :data:`MAX_SECONDS`, or None; ValueError otherwise.

    Bounded, not merely finite: a step time of 1e308 would stretch the join window forever.
    """
    value = msg.get(key, default)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_SECONDS
    ):
        raise ValueError(f"{key} must be a number of seconds from 0 to {MAX_SECONDS:g}, got {value!r:.40}")
    return float(value)


def text(msg: Message, key: str, max_len: int = 256) -> str:
    """``msg[key]`` as a string of at most ``max_len`` characters ("" when absent); ValueError otherwise."""
    value = msg.get(key, "")
    if not isinstance(value, str) or len(value) > max_len:
        raise ValueError(f"{key} must be a string of at most {max_len} characters, got {value!r:.40}")
    return value


def address(msg: Message, key: str) -> str:
    """``msg[key]`` as ``HOST:PORT`` (:func:`unbroken.config.parse_host_port`), or "" when absent;
    ValueError otherwise."""
    value = text(msg, key)
    if value:
        parse_host_port(value, key)
    return value


def _exitcode(msg: Message) -> int | None:
    code = msg.get("exitcode")
    if code is not None and (type(code) is not int or not -256 <= code <= 255):
        raise ValueError(f"exitcode must be an integer from -256 to 255, got {code!r:.40}")
    return code
