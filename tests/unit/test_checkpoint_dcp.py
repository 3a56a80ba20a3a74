"""DCPWriter/DCPReader in one process (DCP runs without a process group): a round trip, plain
DCP reading what unbroken wrote and the reverse, a flipped byte caught with the file named,
and no half checkpoint behind ``latest`` after a save that raised or was killed with kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan

from unbroken.checkpoint import DCPReader, DCPWriter
from unbroken.checkpoint.storage import dcp_layout
from unbroken.checkpoint.storage.disk import CorruptCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
            "view": torch.randn(16, 16, generator=g)[4:8],
        },
        "extra": {"step": seed, "name": f"run-{seed}"},
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "view": torch.zeros(4, 16)},
        "extra": {"step": -1, "name": ""},
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert a["extra"] == b["extra"]


def test_round_trip_commits_a_plain_dcp_directory_and_moves_latest(tmp_path: Path) -> None:
    dcp.save(state(1), storage_writer=DCPWriter(tmp_path, step=1))
    dcp.save(state(2), storage_writer=DCPWriter(tmp_path, step=2))
    assert (tmp_path / "latest").read_text() == "step-00000002"
    assert sorted(os.listdir(tmp_path / "step-00000002")) == [".metadata", "__0_0.distcp", "checksums.json"]

    newest = blank()
    dcp.load(newest, storage_reader=DCPReader(tmp_path))  # the root: the step ``latest`` names
    assert_same(newest, state(2))
    plain = blank()
    dcp.load(plain, checkpoint_id=tmp_path / "step-00000001")  # FileSystemReader, no unbroken code
    assert_same(plain, state(1))
    assert dcp_layout.verify(tmp_path) == str(tmp_path / "step-00000002")


def test_async_save_writes_the_staged_copy(tmp_path: Path) -> None:
    saved = state(3)
    future = dcp.async_save(saved, storage_writer=DCPWriter(tmp_path, step=3))
    saved["model"]["w"].zero_()  # training goes on: the checkpoint holds the copy taken at the call
    future.result()
    loaded = blank()
    dcp.load(loaded, storage_reader=DCPReader(tmp_path))
    assert_same(loaded, state(3))


def test_reads_a_checkpoint_written_by_plain_dcp(tmp_path: Path) -> None:
    dcp.save(state(4), storage_writer=FileSystemWriter(tmp_path / "plain"))
    loaded = blank()
    dcp.load(loaded, storage_reader=DCPReader(tmp_path / "plain"))
    assert_same(loaded, state(4))


def rank0_error(exc: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    """What rank 0 raised inside dcp.save/load (DCP wraps it in a CheckpointException)."""
    return exc.value.failures[0][0]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_a_flipped_byte_is_an_error_naming_the_file(tmp_path: Path, victim: str) -> None:
    dcp.save(state(5), storage_writer=DCPWriter(tmp_path, step=5))
    path = tmp_path / "step-00000005" / victim
    flip_byte(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointException) as exc:
        dcp.load(blank(), storage_reader=DCPReader(tmp_path))
    assert f"{path}: checksum mismatch" in str(exc.value)
    with pytest.raises(CorruptCheckpoint, match=f"{path}: checksum mismatch"):
        dcp_layout.verify(tmp_path)


def test_a_save_that_fails_mid_write_leaves_latest_on_the_last_good_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dcp.save(state(6), storage_writer=DCPWriter(tmp_path, step=6))
    real_save = torch.save

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, torch.Tensor) and obj.numel() == 32:  # the second tensor: the file is half written
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(CheckpointException) as exc:
        dcp.save(state(7), storage_writer=DCPWriter(tmp_path, step=7))
    assert "No space left" in str(rank0_error(exc))
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step-00000006"
    assert not (tmp_path / "step-00000007").exists()
    loaded = blank()
    dcp.load(loaded, storage_reader=DCPReader(tmp_path))
    assert_same(loaded, state(6))
    dcp.save(state(7), storage_writer=DCPWriter(tmp_path, step=7))  # and the retry clears the debris
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000006", "step-00000007"]


KILLED_SAVES = textwrap.dedent("""
    import os, signal, sys
    import torch.distributed.checkpoint as dcp
    from unbroken.checkpoint import DCPWriter
    from unbroken.checkpoint.storage import dcp_storage
    from tests.unit.test_checkpoint_dcp import state
    root = sys.argv[1]
    dcp.save(state(1), storage_writer=DCPWriter(root, step=1))
    real_write, real_rename = dcp_storage._CrcFile.write, os.rename
    def write(self, data):  # kill -9 with the data file half written
        if self.f.tell() > 4096:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, data)
    def rename(src, dst):  # kill -9 between moving the old step aside and moving the new one in
        real_rename(src, dst)
        if dst.endswith(".prev"):
            os.kill(os.getpid(), signal.SIGKILL)
    pid = os.fork()  # one interpreter start (seconds on a busy machine) for both kills
    if pid == 0:
        dcp_storage._CrcFile.write = write
        dcp.save(state(2), storage_writer=DCPWriter(root, step=2))
        os._exit(0)
    if os.waitpid(pid, 0)[1] != signal.SIGKILL:
        sys.exit("the save of step 2 was not killed")
    os.rename = rename
    dcp.save(state(2), storage_writer=DCPWriter(root, step=1))  # step 1 saved again
""")


def test_kill_9_mid_save_never_leaves_latest_on_a_half_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", KILLED_SAVES, str(tmp_path)], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    half = [p for p in tmp_path.glob(".step-00000002.tmp-*/__0_0.distcp")]
    assert half and half[0].stat().st_size > 4096  # really killed mid-write, and ignored
    assert not (tmp_path / "step-00000002").exists()
    assert (tmp_path / "latest").read_text() == "step-00000001"
    loaded = blank()
    dcp.load(loaded, storage_reader=DCPReader(tmp_path))  # the old step 1, moved aside, loads whole
    assert_same(loaded, state(1))


def test_ranks_that_resolved_latest_to_different_steps_refuse_to_load() -> None:
    plans = [LoadPlan([], storage_data="dcp/step-00000002"), LoadPlan([], storage_data="dcp/step-00000003")]
    with pytest.raises(RuntimeError, match="latest moved during the load"):
        DCPReader("dcp").prepare_global_plan(plans)


def test_refuses_a_directory_of_unbroken_checkpointer(tmp_path: Path) -> None:
    (tmp_path / "step-00000001" / "r0-w0").mkdir(parents=True)
    (tmp_path / "latest").write_text("step-00000001")
    with pytest.raises(CheckpointException) as exc:
        dcp.save(state(1), storage_writer=DCPWriter(tmp_path, step=2))
    assert "Checkpointer: give DCP checkpoints a directory of their own" in str(rank0_error(exc))


def step_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def test_keep_last_deletes_old_checkpoints_but_never_for_a_damaged_newer_one(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        dcp.save(state(step), storage_writer=DCPWriter(tmp_path, step=step, keep_last=2))
    assert step_dirs(tmp_path) == ["step-00000002", "step-00000003"]
    data = tmp_path / "step-00000003" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    writer = DCPWriter(tmp_path, step=4, keep_last=2)
    dcp.save(state(4), storage_writer=writer)
    # Step 3 does not verify, so it does not count: steps 4 and 2 are the two kept, 3 stays for
    # inspection (newer than a kept one), and nothing was deleted.
    assert writer.deleted == []
    assert step_dirs(tmp_path) == ["step-00000002", "step-00000003", "step-00000004"]
    writer = DCPWriter(tmp_path, step=5, keep_last=2)
    dcp.save(state(5), storage_writer=writer)
    assert writer.deleted == [2, 3]
    assert step_dirs(tmp_path) == ["step-00000004", "step-00000005"]
    restored = blank()
    dcp.load(restored, storage_reader=DCPReader(tmp_path))
    assert_same(restored, state(5))


def test_keep_last_must_keep_something(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        DCPWriter(tmp_path, step=1, keep_last=0)
