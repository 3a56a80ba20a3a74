"""Commits a checkpoint shard in the test's own process: the persist process's code without the
process, so that a test can damage, interrupt or redirect what it writes."""

from __future__ import annotations

import pickle
from typing import Any

from unbroken.checkpoint.snapshot import HostBuffer, copy_into, flatten
from unbroken.checkpoint.storage import disk, retention
from unbroken.checkpoint.storage.manifest import ShardManifest, layout


def write_shard_here(root: str, state: dict[str, Any], step: int, keep_last: int | None = None) -> None:
    """Writes ``state`` as the one shard of ``step``, moves ``latest``, then applies retention
    when ``keep_last`` is given, as the persist process does."""
    tensors, skeleton = flatten(state)
    manifest = ShardManifest(step, 0, 1, 0, 1, layout([spec for _, spec in tensors.values()]))
    buf = HostBuffer(manifest.data_len)
    try:
        copy_into(buf, manifest.tensors, tensors)
        disk.check_writable(root)
        disk.write_shard(root, manifest, pickle.dumps(skeleton), memoryview(buf.map))
        disk.update_latest(root, step)
        if keep_last is not None:
            retention.apply(root, keep_last)
    finally:
        buf.close()
