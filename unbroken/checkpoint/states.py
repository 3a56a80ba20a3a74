"""The checkpointer's named states: where a restored state came from, and where a host buffer is.

Both are ``str`` enums so that a value compares equal to the string it used to be
(``restored.source == "disk"``), is written as that string in JSON and log lines, and a typo in
the code is an ``AttributeError`` instead of a comparison that is never true.
"""

from __future__ import annotations

import enum


class _Named(str, enum.Enum):
    """A ``str`` enum that prints as its value (``%s``, f-strings), as the plain strings did."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Tier(_Named):
    """Where :class:`~unbroken.checkpoint.checkpointer.Restored` found its state, fastest first."""

    MEMORY = "memory"  # this process's own host-memory snapshot
    PEER = "peer"  # the copy a peer replica holds for this one
    DISK = "disk"  # the durable checkpoint directory


class SlotState(_Named):
    """Where one of the checkpointer's two host buffers is on its way to disk.

    ``FREE`` -> ``WRITING`` (a save copies into it) -> ``PENDING`` (waits for the persist
    process) -> ``INFLIGHT`` (being persisted) -> ``FREE``; a pending snapshot that a newer one
    replaces goes back to ``FREE`` or ``WRITING`` without being persisted.
    """

    FREE = "free"
    WRITING = "writing"
    PENDING = "pending"
    INFLIGHT = "inflight"


__all__ = ["SlotState", "Tier"]
