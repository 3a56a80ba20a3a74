"""Where a process starts (``unbroken.resume``) and what SIGTERM does at a step boundary,
against real checkpoints on disk; the Manager is a stand-in holding a step and a state."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from unbroken.checkpoint import Checkpointer, CheckpointError
from unbroken.checkpoint.storage import disk
from unbroken.train import checkpointing, preemption


@dataclasses.dataclass
class Config:
    checkpoint_dir: str
    restart_count: int = 0
    resume_step: int | None = None
    replica_id: int = 1
    num_replicas: int = 2
    rank: int = 0
    world_size: int = 1


class FakeManager:
    """What resume/save_if_due use of a Manager: its config, step, state and flight recorder."""

    def __init__(self, config: Config, writes: bool = False) -> None:
        self.config = config
        self.recorder = None  # UNBROKEN_RECORDER=0: no telemetry, so no checkpoint costs to report
        self.step = 0
        self.weight = torch.zeros(8)
        self.writes_checkpoints = writes

    def state_dict(self) -> dict[str, Any]:
        return {"user": {"w": self.weight.clone()}, "unbroken": {"step": self.step}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight = state["user"]["w"].clone()
        self.step = int(state["unbroken"]["step"])


REAL_INSTALL = preemption.install


@pytest.fixture(autouse=True)
def no_signal_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """resume() installs a SIGTERM handler: not in the test runner's process."""
    monkeypatch.setattr(preemption, "install", lambda: True)
    preemption._reset_for_tests()


def write_steps(root: str, steps: list[int]) -> None:
    with Checkpointer(root, replica=0, replicas=2) as ck:
        for s in steps:
            ck.save(s, {"user": {"w": torch.full((8,), float(s))}, "unbroken": {"step": s}})
            assert all(o.ok for o in ck.wait())


def test_a_restarted_replica_resumes_from_the_newest_checkpoint_not_step_0(tmp_path: Path) -> None:
    # Every replica died at once: the restarted ones (restart_count > 0) have no live peer to
    # catch up from, so the checkpoint is their only way back.
    root = str(tmp_path / "ckpt")
    write_steps(root, [10, 20])
    m = FakeManager(Config(root, restart_count=3))
    ck = checkpointing.checkpointer_for(m)  # type: ignore[arg-type]
    restored = checkpointing.resume(m, ck)  # type: ignore[arg-type]
    assert restored is not None and m.step == 20 and torch.equal(m.weight, torch.full((8,), 20.0))


def test_a_rollback_target_that_fails_to_load_falls_back_to_the_next_older(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, [10, 20, 30])
    data = Path(root) / "step-00000020" / "r0-w0" / "data.safetensors"
    with open(data, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    m = FakeManager(Config(root, resume_step=20, restart_count=1))
    checkpointing.resume(m, checkpointing.checkpointer_for(m))  # type: ignore[arg-type]
    assert m.step == 10  # not 30 (the undone history), not 0


def test_a_process_with_only_damaged_checkpoints_refuses_to_start_over(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, [10])
    (Path(root) / "step-00000010" / "r0-w0" / "objects.pkl").write_bytes(b"junk")
    # First start or restart: when every replica restarts at once none is ahead to catch up
    # from, and step 0 would train from scratch beside checkpoints retention then keeps instead.
    for restarts in (0, 1):
        m = FakeManager(Config(root, restart_count=restarts))
        with pytest.raises(CheckpointError, match="none loads.*step 10"):
            checkpointing.resume(m, checkpointing.checkpointer_for(m))  # type: ignore[arg-type]
        assert m.step == 0


def test_sigterm_flushes_every_replica_at_the_next_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "ckpt")
    exits: list[int] = []
    monkeypatch.setattr(preemption, "exit_now", lambda code=preemption.EXIT_PREEMPTED: exits.append(code))
    m = FakeManager(Config(root), writes=False)  # not the replica that writes periodic checkpoints
    ck = checkpointing.checkpointer_for(m)  # type: ignore[arg-type]
    m.step, m.weight = 7, torch.full((8,), 7.0)
    assert not checkpointing.save_if_due(m, ck, every=5)  # type: ignore[arg-type]
    preemption._on_sigterm(signal.SIGTERM, None)
    checkpointing.save_if_due(m, ck, every=5)  # type: ignore[arg-type]
    assert exits == [preemption.EXIT_PREEMPTED]
    assert disk.complete_steps(root) == [7]
    with Checkpointer(root) as fresh:
        assert torch.equal(fresh.load_latest().state["user"]["w"], torch.full((8,), 7.0))


def test_the_sigterm_handler_chains_an_earlier_one(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    monkeypatch.setattr(preemption, "_installed", False)
    try:
        assert REAL_INSTALL()
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the handler only raises a flag
        assert preemption.requested() and seen == [signal.SIGTERM]
        assert preemption.should_stop(12, world_size=1)
    finally:
        signal.signal(signal.SIGTERM, before)
        monkeypatch.setattr(preemption, "_previous", None)
