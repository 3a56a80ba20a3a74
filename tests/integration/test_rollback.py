"""Checkpoints of a running job: a relaunched job resumes, a poisoned one rolls back."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.integration.harness import PACE, Job, assert_identical
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.storage import history
from unbroken.checkpoint.storage.disk import complete_steps

pytestmark = pytest.mark.integration


def test_nan_gradients_roll_the_whole_job_back_to_the_last_good_checkpoint(tmp_path: Path) -> None:
    # Replica 1's NaN gradient at step 25 is averaged into every replica: no replica's state is
    # good any more, so restarting one (or skipping a step) cannot help; the checkpoint of step 20 can.
    ckpt = tmp_path / "ckpt"
    extra = [
        "--checkpoint-dir",
        str(ckpt),
        "--anomaly-policy",
        "nonfinite_loss=rollback,nonfinite_grad=rollback",
        "--fault",
        "nan_loss:replica=1,step=25,poison_grads=true",
    ]
    with Job(
        tmp_path / "run", replicas=3, steps=45, extra=extra, train_args=PACE + ["--checkpoint-every", "10"]
    ) as job:
        assert job.wait(150) == 0
    rollbacks = job.events("rollback")
    assert [(e["step"], e["anomaly_step"]) for e in rollbacks] == [(20, 25)], rollbacks
    resumed = [e for e in job.events("process_started") if e.get("resume_step") is not None]
    assert sorted(e["replica"] for e in resumed) == [0, 1, 2] and {e["resume_step"] for e in resumed} == {20}

    finals = job.final_states()
    assert_identical(finals)
    for state in finals.values():
        assert all(torch.isfinite(p).all() for p in state["model"].values()), "the poison survived the rollback"
    losses = [row["loss"] for row in job.metrics(0) if row["committed"]]
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0]

    # The rollback was recorded before any process stopped: no tier may offer the undone steps.
    assert history.read(str(ckpt)).fences == (history.Fence(1, 20),)
    # The checkpoints of the abandoned history are gone; the newest one loads and is healthy.
    assert max(complete_steps(str(ckpt))) == 40
    with Checkpointer(str(ckpt)) as ck:
        restored = ck.load_latest()
    assert restored.state["unbroken"]["step"] == 40
    assert all(torch.isfinite(t).all() for t in restored.state["user"]["model"].values())


@pytest.mark.scenario
def test_a_relaunched_job_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = PACE + ["--checkpoint-every", "5"]
    with Job(tmp_path / "first", replicas=2, steps=20, extra=["--checkpoint-dir", str(ckpt)], train_args=args) as job:
        assert job.wait(90) == 0
    assert max(complete_steps(str(ckpt))) == 20
    with Job(tmp_path / "second", replicas=2, steps=30, extra=["--checkpoint-dir", str(ckpt)], train_args=args) as job:
        assert job.wait(90) == 0
    steps = [row["step"] for row in job.metrics(0) if row["committed"]]
    assert steps[0] == 20 and steps[-1] == 29, steps[:3]
    assert_identical(job.final_states())


def test_an_unwritable_checkpoint_directory_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with Job(tmp_path / "run", replicas=2, steps=10, extra=["--checkpoint-dir", str(blocker / "ckpt")]) as job:
        assert job.wait(30) == 2  # click's usage error
    assert "cannot be created" in (tmp_path / "run-launcher.log").read_text()
    assert not (tmp_path / "run" / "events.jsonl").exists() or not job.events("process_started")


# The same fallback is checked without processes in tests/unit/train/test_resume.py; this end-to-end run
# (20 s) is a scenario.
@pytest.mark.scenario
def test_a_rollback_target_that_does_not_load_gives_way_to_the_next_older(tmp_path: Path) -> None:
    # The newest checkpoint before the anomaly (15) is damaged after it was written: the rollback
    # must take 10, not restart the job from step 0, and must delete nothing before it knows.
    import os
    import time

    ckpt = tmp_path / "ckpt"
    extra = [
        "--checkpoint-dir",
        str(ckpt),
        "--anomaly-policy",
        "nonfinite_loss=rollback,nonfinite_grad=rollback",
        "--fault",
        "nan_loss:replica=1,step=19,poison_grads=true",
    ]
    with Job(
        tmp_path / "run", replicas=2, steps=25, extra=extra, train_args=["--pace-s", "0.2", "--checkpoint-every", "5"]
    ) as job:
        deadline = time.monotonic() + 120
        while 15 not in complete_steps(str(ckpt)):
            assert time.monotonic() < deadline and job.proc.poll() is None, "step 15 was never saved"
            time.sleep(0.02)
        data = ckpt / "step-00000015" / "r0-w0" / "data.safetensors"
        with open(data, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        damaged_before_verdict = not job.events("rollback")
        assert job.wait(150) == 0
    assert damaged_before_verdict, "the verdict came before the damage: the test proved nothing"
    (rollback,) = job.events("rollback")
    assert rollback["step"] == 10 and "step 15" in rollback["skipped"][0], rollback
    restarted = {e["pid"] for e in job.events("process_started") if e.get("resume_step") == 10}
    for r in (0, 1):
        first = [row["step"] for row in job.metrics(r) if row["committed"] and row["pid"] in restarted]
        assert first and first[0] == 10, (r, first[:3])
    assert_identical(job.final_states())
    assert max(complete_steps(str(ckpt))) == 25
