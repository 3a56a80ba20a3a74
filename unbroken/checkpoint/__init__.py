"""Tiered asynchronous checkpoints: host-memory snapshot, peer tier (peer.py), durable disk.

Names are imported lazily so that the persist process, which imports this package's disk
modules, never pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "unbroken.checkpoint.checkpointer",
    "CheckpointError": "unbroken.checkpoint.checkpointer",
    "DCPReader": "unbroken.checkpoint.storage.dcp_storage",
    "DCPWriter": "unbroken.checkpoint.storage.dcp_storage",
    "PersistOutcome": "unbroken.checkpoint.checkpointer",
    "Restored": "unbroken.checkpoint.checkpointer",
    "Shard": "unbroken.checkpoint.snapshot",
    "Tier": "unbroken.checkpoint.states",
    "PeerStore": "unbroken.checkpoint.peer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
