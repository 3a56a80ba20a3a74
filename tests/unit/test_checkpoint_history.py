"""After a rollback to step S, no tier offers a step of the undone history to any process.

Real checkpoints, a real persist process and a real peer store; the rollback is recorded as the
supervisor records it (:func:`unbroken.checkpoint.storage.history.record_rollback`), and a "restarted
process" is a new Checkpointer on the same directory and peer.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from unbroken.checkpoint import Checkpointer, CheckpointError
from unbroken.checkpoint.peer import PeerStore
from unbroken.checkpoint.storage import disk, history, retention
from unbroken.wire.auth import JobSecret

SECRET = JobSecret.generate()


def state(step: int) -> dict:
    return {"user": {"w": torch.full((8,), float(step))}, "unbroken": {"step": step}}


def save(ck: Checkpointer, steps: list[int]) -> None:
    for s in steps:
        ck.save(s, state(s))
        assert all(o.ok for o in ck.wait())


@pytest.fixture
def peer() -> Iterator[PeerStore]:
    store = PeerStore(SECRET).start()
    yield store
    store.close()


def test_fences_undo_newer_steps_of_older_histories_only() -> None:
    f = history.Fences().after_rollback(20)
    assert f.current == 1
    assert f.undone(20, 0) is None and f.undone(30, 0) and f.undone(30, 1) is None
    g = f.after_rollback(15)  # the new history rolled back too: its 20 is undone, so is the first's
    assert g.current == 2 and g.undone(20, 1) and g.undone(16, 0) and g.undone(15, 0) is None
    assert history.Fences.from_json(g.to_json()) == g
    with pytest.raises(ValueError, match="damaged"):
        history.Fences.from_json('{"fences": [[1, -5]]}')


def test_many_rollbacks_keep_a_bounded_record_that_never_lets_an_undone_step_back() -> None:
    f = history.Fences()
    for i in range(200):
        f = f.after_rollback(1000 - i)
    assert len(f.fences) == history.MAX_FENCES
    exact = [(h, 1000 - (h - 1)) for h in range(1, 201)]  # history h began at step 1000 - (h - 1)
    for h in range(0, 200):
        ceiling = min(step for later, step in exact if later > h)
        assert f.undone(ceiling + 1, h)  # what the full record undoes stays undone


def test_a_peer_copy_of_the_undone_history_is_not_loaded_by_a_restarted_process(
    tmp_path: Path, peer: PeerStore
) -> None:
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, peer=peer.address, secret=SECRET) as ck:
        save(ck, [10, 20, 30])  # the peer holds step 30: the newest push
    history.record_rollback(root, 20)
    assert retention.discard_newer(root, 20) == [30]  # the disk is clean; the peer is not
    with Checkpointer(root, peer=peer.address, secret=SECRET) as restarted:
        got = restarted.load_latest()
        assert got.step == 20 and got.source == "disk"
        assert any("step 30 from peer" in s and "undone" in s for s in got.skipped), got.skipped
        save(restarted, [25])  # the new history's own step reaches the peer and loads from it
    with Checkpointer(root, peer=peer.address, secret=SECRET) as again:
        got = again.load_latest()
        assert (got.step, got.source) == (25, "peer")
        assert torch.equal(got.state["user"]["w"], torch.full((8,), 25.0))


def test_a_disk_step_of_the_undone_history_that_was_not_deleted_never_loads(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, replica=1, replicas=2) as ck:
        save(ck, [10, 20, 30, 40])
    history.record_rollback(root, 20)  # ...and the discard of 30 and 40 failed: they stay
    assert disk.complete_steps(root) == [40, 30, 20]
    # The supervisor's next rollback target and every restarted process skip them.
    assert disk.newest_verified_step(root, 35)[0] == 20
    with Checkpointer(root, replica=0, replicas=2, keep_last=1) as restarted:
        got = restarted.load_latest()
        assert got.step == 20 and any("undone by the rollback to step 20" in s for s in got.skipped)
        # The new history saves 30 again, beside the undone shard of replica 1: its own loads.
        save(restarted, [25, 30])
    with Checkpointer(root, replica=1, replicas=2) as again:
        got = again.load_latest()
        assert got.step == 30 and torch.equal(got.state["user"]["w"], torch.full((8,), 30.0))
        assert got.state["unbroken"]["step"] == 30
    # Retention (keep_last=1) counted the new 30, not the undone 40: nothing of the new
    # history was deleted for it, and what is older than the new 30 is gone.
    assert 30 in disk.complete_steps(root) and 25 not in disk.complete_steps(root)


def test_retention_does_not_delete_the_new_historys_saves_below_an_undone_step(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    with Checkpointer(root) as ck:
        save(ck, [10, 20, 30, 40])
    history.record_rollback(root, 20)
    with Checkpointer(root, keep_last=1) as restarted:
        assert restarted.load_latest().step == 20
        save(restarted, [25])
    # Before: 40 verified, counted as the one to keep, and 25 deleted as it completed.
    assert 25 in disk.complete_steps(root)
    with Checkpointer(root) as again:
        assert again.load_latest().step == 25


def test_an_unreadable_rollback_record_refuses_every_load(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    with Checkpointer(root) as ck:
        save(ck, [10])
    (Path(root) / history.FENCE_FILE).write_text("{not json")
    with pytest.raises(disk.CorruptCheckpoint, match="rollbacks"):
        Checkpointer(root)
    assert (Path(root) / history.FENCE_FILE).stat().st_size  # nothing repaired it behind our back


def test_the_rollback_record_is_the_jobs_own(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    history.record_rollback(str(root), 5)
    assert (root / history.FENCE_FILE).stat().st_mode & 0o777 == 0o600
    with pytest.raises(CheckpointError):
        with Checkpointer(str(root)) as ck:
            ck.load_latest()


def _immutable(path: Path, on: bool) -> bool:
    """chattr +i / -i (root on ext4 and most local filesystems): even root cannot rename it."""
    chattr = shutil.which("chattr")
    return (
        chattr is not None
        and subprocess.run([chattr, "+i" if on else "-i", str(path)], capture_output=True).returncode == 0
    )


def test_a_step_the_rollbacks_discard_could_not_delete_never_loads(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep_last=5) as ck:
        save(ck, [10, 20, 30, 40])
    stuck = Path(root) / "step-00000040"
    if not _immutable(stuck, True):
        pytest.skip("needs chattr +i (root, a filesystem with the immutable flag)")
    try:
        history.record_rollback(root, 20)
        with pytest.raises(OSError):
            retention.discard_newer(root, 20)  # what the supervisor reports as checkpoints_kept
        assert disk.complete_steps(root) == [40, 30, 20, 10]  # the undone steps are all still there
        assert disk.newest_verified_step(root)[0] == 20
        with Checkpointer(root, keep_last=1) as restarted:
            got = restarted.load_latest()
            assert got.step == 20 and sum("undone by the rollback to step 20" in s for s in got.skipped) == 2
            save(restarted, [25])
        with Checkpointer(root) as again:
            assert again.load_latest().step == 25  # kept by retention: 40 is not counted
    finally:
        _immutable(stuck, False)
