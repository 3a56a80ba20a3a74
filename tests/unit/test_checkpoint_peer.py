"""The peer tier and checkpoint objects: only key holders push or fetch, a push is whole and
consistent or refused with its reason, and no checkpoint ever runs code when it loads."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.shard_writer import write_shard_here
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.peer import PeerClient, PeerError, PeerStore
from unbroken.checkpoint.storage import checksum
from unbroken.checkpoint.storage.manifest import ShardManifest, TensorSpec, layout, with_checksums
from unbroken.wire import objects
from unbroken.wire.auth import AuthError, JobSecret

SECRET = JobSecret.generate()


def _copy(step: int, value: float = 1.0, objects_bytes: bytes | None = None) -> tuple[ShardManifest, bytes, bytes]:
    """A shard of one tensor, with every checksum: what a persist process pushes."""
    t = torch.full((4,), value)
    entries = layout([TensorSpec("w", "float32", (4,), (4,), (0,))])
    data = t.numpy().tobytes()
    blob = objects_bytes if objects_bytes is not None else objects.dumps({"step": step})
    manifest = ShardManifest(
        step,
        0,
        1,
        0,
        1,
        with_checksums(entries, {"w": checksum.update(data)}),
        objects_len=len(blob),
        objects_crc32=checksum.update(blob),
    )
    return manifest, blob, data


@pytest.fixture
def store() -> Iterator[PeerStore]:
    s = PeerStore(SECRET).start()
    yield s
    s.close()


def _client(store: PeerStore, secret: JobSecret = SECRET) -> PeerClient:
    return PeerClient(*store.address, secret, timeout=5.0)


def test_nobody_without_the_key_pushes_or_downloads(store: PeerStore) -> None:
    _client(store).put("r0-w0", *_copy(3)[:2], memoryview(_copy(3)[2]))
    stranger = _client(store, JobSecret.generate())
    with pytest.raises(AuthError):
        stranger.get("r0-w0")
    with pytest.raises(AuthError):
        stranger.put("r0-w0", *_copy(10**9)[:2], memoryview(_copy(10**9)[2]))
    # The unauthenticated wire format of main: a put with a huge step, then a get.
    manifest, blob, data = _copy(10**9)
    header = json.dumps(
        {"op": "put", "owner": "r0-w0", "manifest": manifest.to_json(), "objects_len": len(blob), "data_len": len(data)}
    ).encode()
    with socket.create_connection(store.address, timeout=5.0) as s:
        # The server hangs up after its handshake times out or fails: a reset (or a socket
        # already disconnected by the time we shut it) is its answer too.
        with contextlib.suppress(OSError):
            s.sendall(len(header).to_bytes(8, "little") + header + blob + data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(1 << 16):
                pass
    assert store.owners() == {"r0-w0": 3}
    got = _client(store).get("r0-w0")
    assert got is not None and got.manifest.step == 3


def test_a_later_push_of_a_lower_step_is_kept_not_answered_ok_and_dropped(store: PeerStore) -> None:
    """After a rollback the owner pushes lower steps; the peer must serve those, not the undone state."""
    client = _client(store)
    manifest, blob, data = _copy(10)
    client.put("r0-w0", manifest, blob, memoryview(data))
    manifest, blob, data = _copy(5, value=2.0)
    client.put("r0-w0", manifest, blob, memoryview(data))
    got = client.get("r0-w0")
    assert store.owners() == {"r0-w0": 5}
    assert got is not None and got.manifest.step == 5 and got.data == bytearray(data)
    got.verify()


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda m, b, d: (m, b, d[:-1] + bytes([d[-1] ^ 1])), "checksum mismatch in tensor 'w'"),
        (lambda m, b, d: (ShardManifest(**{**m.__dict__, "objects_crc32": None}), b, d), "lacks checksums"),
        (lambda m, b, d: (ShardManifest(**{**m.__dict__, "objects_len": len(b) + 1}), b, d), "announced"),
    ],
)
def test_a_push_that_does_not_match_its_manifest_is_refused_and_the_copy_kept(
    store: PeerStore, damage: Callable, reason: str
) -> None:
    client = _client(store)
    client.put("r0-w0", *_copy(3)[:2], memoryview(_copy(3)[2]))
    manifest, blob, data = damage(*_copy(4))
    with pytest.raises(PeerError, match=reason):
        client.put("r0-w0", manifest, blob, memoryview(data))
    assert store.owners() == {"r0-w0": 3}


def test_bad_owners_and_copies_over_capacity_are_refused() -> None:
    store = PeerStore(SECRET, max_bytes=100).start()
    try:
        client = _client(store)
        manifest, blob, data = _copy(3)
        with pytest.raises(PeerError, match="owner"):
            client.put("../../etc", manifest, blob, memoryview(data))
        client.put("a", manifest, blob, memoryview(data))  # 16 data bytes and the objects
        with pytest.raises(PeerError, match="over its 100 bytes"):
            for owner in "bcdefgh":
                client.put(owner, manifest, blob, memoryview(data))
        assert "a" in store.owners() and len(store.owners()) < 8
    finally:
        store.close()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., int], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_whose_objects_would_run_code_is_skipped_and_nothing_runs(tmp_path: Path) -> None:
    """On main, loading objects.pkl was pickle.loads: a planted checkpoint ran its code."""
    root, marker = str(tmp_path / "ck"), tmp_path / "ran"
    write_shard_here(root, {"w": torch.ones(2), "n": 1}, step=1)
    write_shard_here(root, {"w": torch.ones(2), "n": _RunsCode(marker)}, step=2)
    with Checkpointer(root) as ck:
        restored = ck.load_latest()
    assert not marker.exists()
    assert restored.step == 1 and restored.state["n"] == 1
    assert "refusing to load the global" in restored.skipped[0] and "system" in restored.skipped[0]


def test_a_peer_copy_whose_objects_would_run_code_is_skipped(tmp_path: Path, store: PeerStore) -> None:
    marker = tmp_path / "ran"
    manifest, blob, data = _copy(9, objects_bytes=pickle.dumps({"w": _RunsCode(marker)}))
    _client(store).put("r0-w0", manifest, blob, memoryview(data))
    root = str(tmp_path / "ck")
    write_shard_here(root, {"w": torch.ones(4)}, step=1)
    with Checkpointer(root, peer=store.address, secret=SECRET) as ck:
        restored = ck.load_latest()
    assert not marker.exists() and restored.step == 1 and "step 9 from peer" in restored.skipped[0]


def test_a_state_that_would_not_load_back_is_refused_at_save(tmp_path: Path) -> None:
    with Checkpointer(str(tmp_path / "ck")) as ck, pytest.raises(ValueError, match="cannot be checkpointed"):
        ck.save(1, {"w": torch.ones(2), "f": os.getcwd})


def test_objects_of_older_checkpoints_still_load() -> None:
    """objects.pkl written by earlier versions (any pickle protocol) loads if it holds allowed types."""
    from collections import OrderedDict

    from unbroken.checkpoint.snapshot import TensorRef

    skeleton = {
        "model": OrderedDict(w=TensorRef("model/w", False)),
        "step": 3,
        "betas": (0.9, 0.95),
        "size": torch.Size([2]),
        "dtype": torch.float16,
        "s": {1},
        "b": b"x",
        "none": None,
    }
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert objects.loads(pickle.dumps(skeleton, protocol=protocol)) == skeleton


def test_the_persist_process_pushes_with_the_key(tmp_path: Path, store: PeerStore) -> None:
    root = str(tmp_path / "ck")
    with Checkpointer(root, peer=store.address, secret=SECRET) as ck:
        ck.save(4, {"w": torch.arange(3.0)})
        (outcome,) = ck.wait()
    assert outcome.ok and outcome.peer_error is None and store.owners() == {"r0-w0": 4}
    with pytest.raises(ValueError, match="secret"):
        Checkpointer(root, peer=store.address)
