"""Checkpoints of a running job: a relaunched job resumes, a poisoned one rolls back."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.integration.harness import PACE, Job, assert_identical
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.disk import complete_steps

pytestmark = pytest.mark.integration


def test_nan_gradients_roll_the_whole_job_back_to_the_last_good_checkpoint(tmp_path: Path) -> None:
    # Replica 1's NaN gradient at step 25 is averaged into every replica: no replica's state is
    # good any more, so restarting one (or skipping a step) cannot help; the checkpoint of step 20 can.
    ckpt = tmp_path / "ckpt"
    extra = ["--checkpoint-dir", str(ckpt), "--anomaly-policy", "nonfinite_loss=rollback,nonfinite_grad=rollback",
             "--fault", "nan_loss:replica=1,step=25,poison_grads=true"]
    with Job(tmp_path / "run", replicas=3, steps=45, extra=extra, train_args=PACE + ["--checkpoint-every", "10"]) as job:
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

    # The checkpoints of the abandoned history are gone; the newest one loads and is healthy.
    assert max(complete_steps(str(ckpt))) == 40
    with Checkpointer(str(ckpt)) as ck:
        restored = ck.load_latest()
    assert restored.state["unbroken"]["step"] == 40
    assert all(torch.isfinite(t).all() for t in restored.state["user"]["model"].values())


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
