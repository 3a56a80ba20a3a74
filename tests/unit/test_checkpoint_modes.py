"""A checkpoint is the job's own: its files are 0600 and its directories 0700, whatever the umask."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unbroken.checkpoint import Checkpointer, DCPWriter
from unbroken.checkpoint.storage import history


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0o022)  # the usual default: files 0644, directories 0755
    yield
    os.umask(old)


def modes(root: Path) -> tuple[set[int], set[int]]:
    files, dirs = set(), set()
    for path in root.rglob("*"):
        (dirs if path.is_dir() else files).add(path.stat().st_mode & 0o777)
    return files, dirs


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_file_and_directory_of_a_checkpoint_is_private(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(str(root)) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.ones(4), "step": step})
            assert all(o.ok for o in ck.wait())
        ck.load_latest()  # writes the verified marker
    history.record_rollback(str(root), 1)
    dcp.save({"w": torch.ones(4), "extra": {"n": 1}}, storage_writer=DCPWriter(tmp_path / "dcp", step=3))
    for tree in (root, tmp_path / "dcp"):
        files, dirs = modes(tree)
        assert files == {0o600}, (tree, files)
        assert dirs <= {0o700}, (tree, dirs)
    assert root.stat().st_mode & 0o777 == 0o700  # created by the Checkpointer
