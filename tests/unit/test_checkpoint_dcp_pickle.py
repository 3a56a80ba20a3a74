"""A DCP checkpoint never runs code when DCPReader loads it: neither its ``.metadata`` (a pickle)
nor its non-tensor items (``torch.save`` bytes that DCP's planner loads with weights_only=False).

The checkpoints are written by plain DCP (FileSystemWriter: no checksums, as DCPReader accepts),
which is what anyone who can write the checkpoint directory can also write. Plain objects
still load: tests/unit/test_checkpoint_dcp.py round-trips a state with strings and numbers.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from unbroken.checkpoint import DCPReader
from unbroken.checkpoint.storage.dcp_storage import load_metadata
from unbroken.wire.objects import UnsafeObjectError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickling this runs a shell command (what an attacker's checkpoint would hold)."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.mark}",))


def test_a_metadata_that_names_a_function_is_refused_before_it_runs(tmp_path: Path) -> None:
    ckpt = tmp_path / "plain"
    dcp.save({"w": torch.ones(4)}, storage_writer=FileSystemWriter(ckpt))
    real = (ckpt / ".metadata").read_bytes()
    assert load_metadata(real).state_dict_metadata.keys() == {"w"}  # DCP's own metadata loads
    mark = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(mark)))
    with pytest.raises((CheckpointException, UnsafeObjectError), match="os.system|posix.system"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=DCPReader(ckpt))
    assert not mark.exists()


def test_a_non_tensor_item_that_names_a_function_is_refused_before_it_runs(tmp_path: Path) -> None:
    ckpt = tmp_path / "plain"
    mark = tmp_path / "ran"
    dcp.save({"w": torch.ones(4), "extra": Payload(mark)}, storage_writer=FileSystemWriter(ckpt))
    assert not mark.exists()  # saving pickles the payload; only a load would run it
    with pytest.raises(CheckpointException, match="weights_only"):
        dcp.load({"w": torch.zeros(4), "extra": None}, storage_reader=DCPReader(ckpt))
    assert not mark.exists()


def test_a_metadata_built_to_take_exponential_time_is_refused_fast(tmp_path: Path) -> None:
    from tests.unit.wire.test_objects_expansion import doubling

    ckpt = tmp_path / "plain"
    state = {f"layer{i}": {"w": torch.ones(2, 2), "b": torch.ones(2), "n": i} for i in range(500)}
    dcp.save(state, storage_writer=FileSystemWriter(ckpt))
    real = (ckpt / ".metadata").read_bytes()
    assert len(load_metadata(real).state_dict_metadata) == 1500  # a real one is well within the bounds
    for hostile, refusal in (
        (doubling(25, b"(TOP\x91"), "shared references"),  # frozenset({...}): 2**25 hashes unbounded
        (b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b".", "nest containers 100000 deep"),
    ):
        (ckpt / ".metadata").write_bytes(hostile)
        began = time.thread_time()
        with pytest.raises((CheckpointException, UnsafeObjectError), match=refusal) as e:
            dcp.load({"w": torch.zeros(4)}, storage_reader=DCPReader(ckpt))
        assert time.thread_time() - began < 3.0  # the unbounded walk takes minutes; a loaded machine, seconds
        assert "the checkpoint's" in str(e.value) and ".metadata" in str(e.value)


def test_a_non_tensor_item_built_to_take_exponential_time_is_refused_fast(tmp_path: Path) -> None:
    """A value of 2**40 items in a few hundred bytes (each level names the one below twice): a
    walk, a comparison or a hash of it after loading would never end."""
    deep: tuple[object, ...] = ()
    for _ in range(40):
        deep = (deep, deep)
    ckpt = tmp_path / "plain"
    dcp.save({"w": torch.ones(4), "extra": {"k": deep}}, storage_writer=FileSystemWriter(ckpt))
    began = time.thread_time()
    with pytest.raises(CheckpointException, match="'extra.k' at offset .* shared references"):
        dcp.load({"w": torch.zeros(4), "extra": {"k": None}}, storage_reader=DCPReader(ckpt))
    assert time.thread_time() - began < 1.0
    ckpt2 = tmp_path / "fine"
    dcp.save({"w": torch.ones(4), "extra": {"k": ("a", 1, [2.5, None])}}, storage_writer=FileSystemWriter(ckpt2))
    loaded: dict[str, Any] = {"w": torch.zeros(4), "extra": {"k": None}}
    dcp.load(loaded, storage_reader=DCPReader(ckpt2))
    assert loaded["extra"]["k"] == ("a", 1, [2.5, None])
