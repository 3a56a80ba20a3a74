"""No path of the disk tier loses the last good checkpoint: retention, validation, re-saves
and rollbacks, driven in this process (the persist process's code, without the process)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.shard_writer import write_shard_here
from unbroken.checkpoint import Checkpointer, CheckpointError
from unbroken.checkpoint.storage import disk, retention
from unbroken.checkpoint.storage.manifest import MANIFEST_FILE, ShardManifest, TensorSpec, layout


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 4, generator=g), "n": torch.tensor(seed), "step": seed}


def save(root: str, step: int, keep_last: int | None = None) -> None:
    """Commit step ``step`` as the persist process does, retention included."""
    write_shard_here(root, state(step), step, keep_last)


def shard(root: str, step: int) -> Path:
    return Path(root) / f"step-{step:08d}" / "r0-w0"


def flip_byte(root: str, step: int) -> None:
    data = shard(root, step) / "data.safetensors"
    with open(data, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


def load(root: str, **kw: Any) -> Any:
    with Checkpointer(root) as ck:
        return ck.load_latest(**kw)


@pytest.fixture
def root(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


def test_keep_last_counts_only_checkpoints_that_verify(root: str) -> None:
    save(root, 1, keep_last=1)
    save(root, 2)
    flip_byte(root, 2)  # the newest is damaged before retention runs
    assert retention.apply(root, keep_last=1) == []
    restored = load(root)
    assert restored.step == 1 and "checksum mismatch" in restored.skipped[0]
    save(root, 3, keep_last=1)  # a good newer one: now the older ones may go
    assert disk.list_steps(root) == [3]
    assert (shard(root, 3) / "verified").exists()
    assert load(root).step == 3


def test_retention_plan_waits_for_keep_last_verified_steps() -> None:
    assert retention.plan([50, 45, 40, 30, 20, 10], [45, 30], keep_last=2) == [10, 20]
    assert retention.plan([50, 45, 40], [45], keep_last=2) == []  # one verified of two: keep all


def manifest_json(**tensor_fields: Any) -> str:
    m = ShardManifest(3, 0, 1, 0, 1, layout([TensorSpec("w", "float32", (4, 2), (4, 2), (0, 0))]))
    raw = json.loads(m.to_json())
    raw["tensors"][0].update(tensor_fields)
    return json.dumps(raw)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"shape": [-1, -8], "global_shape": [-1, -8]}, "negative or out of bounds"),
        ({"shape": [4, 2], "global_offset": [-1, 0]}, "negative or out of bounds"),
        ({"shape": [4, 2.5]}, "not a list of integers"),
        ({"shape": [4], "global_shape": [4, 2]}, "differ in rank"),
        ({"begin": -32, "end": 0}, "out of range"),
        ({"global_shape": [2**40, 2**40], "shape": [4, 2]}, "implausibly large"),
        ({"crc32": 2**40}, "32-bit"),
        ({"dtype": ["float32"]}, "not a name"),
    ],
)
def test_manifest_validation_rejects_impossible_layouts(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardManifest.from_json(manifest_json(**fields))


def test_a_manifest_with_negative_dimensions_falls_back_to_the_older_checkpoint(root: str) -> None:
    save(root, 1)
    save(root, 2)
    path = shard(root, 2) / MANIFEST_FILE
    raw = json.loads(path.read_text())
    for t in raw["tensors"]:  # same byte count, impossible shape
        if t["name"] == "w":
            t["shape"] = t["global_shape"] = [-64, -4]
    path.write_text(json.dumps(raw))
    restored = load(root)
    assert restored.step == 1 and torch.equal(restored.state["w"], state(1)["w"])
    assert 2 not in disk.complete_steps(root)  # its manifest is refused, so it counts as absent


def test_any_load_error_of_one_checkpoint_falls_back(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    save(root, 1)
    save(root, 2)
    real = Checkpointer._from_disk

    def broken_at_2(self: Checkpointer, step: int, *a: Any) -> Any:
        if step == 2:
            raise RuntimeError("some error no one foresaw")
        return real(self, step, *a)

    monkeypatch.setattr(Checkpointer, "_from_disk", broken_at_2)
    restored = load(root)
    assert restored.step == 1 and "no one foresaw" in restored.skipped[0]
    assert load(root, at_most=1).step == 1
    with pytest.raises(CheckpointError, match="up to step 0"):
        load(root, at_most=0)


def test_a_crash_between_the_renames_of_a_resave_keeps_the_old_shard(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(root, 1)
    save(root, 5)
    real_rename = os.rename
    calls: list[str] = []

    def crash_after_first(src: Any, dst: Any) -> None:
        calls.append(str(dst))
        if len(calls) == 2:
            raise OSError("the machine died here")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_after_first)
    with pytest.raises(OSError, match="died"):
        save(root, 5)  # the same step again, say after a restart
    monkeypatch.setattr(os, "rename", real_rename)
    assert len(calls) == 2
    assert 5 in disk.complete_steps(root)
    restored = load(root)
    assert restored.step == 5 and torch.equal(restored.state["w"], state(5)["w"])
    disk.verify_step(root, 5)
    save(root, 5)  # the next re-save commits normally and tidies up
    assert os.listdir(shard(root, 5).parent) == ["r0-w0"]
    assert load(root).step == 5


def test_discard_newer_checks_the_target_first_and_moves_latest_back(root: str) -> None:
    for step in (10, 20, 30):
        save(root, step)
    flip_byte(root, 20)
    with pytest.raises(disk.CorruptCheckpoint):
        retention.discard_newer(root, 20)
    assert disk.list_steps(root) == [30, 20, 10]  # nothing deleted for a target that does not load
    assert disk.newest_verified_step(root, at_most=25)[0] == 10
    assert retention.discard_newer(root, 10) == [20, 30]
    assert disk.read_latest(root) == 10 and disk.list_steps(root) == [10]
    assert retention.discard_newer(root, 10) == []  # again: nothing more to do
