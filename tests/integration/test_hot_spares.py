"""``unbroken run --hot-spares``: a spare started with the job takes a killed replica's place."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.harness import PACE, Job, assert_identical, load_finals

pytestmark = [pytest.mark.integration, pytest.mark.scenario]


def test_a_hot_spare_takes_a_killed_replicas_place_and_its_restart_waits(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with Job(run_dir, replicas=2, steps=60, extra=["--hot-spares", "1"]) as job:
        job.wait_for_step(1, 15)
        killed_at = job.metrics(1)[-1]["step"]
        os.kill(job.pid(1), signal.SIGKILL)
        assert job.wait(240) == 0
        quorums = job.events("quorum")
        started = [e["replica"] for e in job.events("process_started")]
    assert all(len(q["members"]) <= 2 for q in quorums), "an epoch took more members than --replicas"
    assert quorums[0]["members"] == [0, 1], "the spare (the highest id) trained before anyone was lost"
    taken = [q for q in quorums if q["members"] == [0, 2]]
    assert taken and taken[0]["behind"] == [2], "the spare never took the killed replica's place"
    assert taken[0]["step"] <= killed_at + 3, (taken[0]["step"], killed_at)
    assert started.count(1) == 2, "the killed replica was not restarted"
    after = [q for q in quorums if q["epoch"] >= taken[0]["epoch"]]
    assert all(1 not in q["members"] for q in after), "the restart displaced a replica that trains"
    finals = load_finals(run_dir, [0, 1, 2])
    assert set(finals) == {0, 2}, "the replicas that trained to the end are the survivor and the spare"
    assert_identical(finals)


def test_a_hung_member_whose_place_a_spare_took_waits_parked_when_it_resumes(tmp_path: Path) -> None:
    """Resumed after a spare took its place, the member asks into a full epoch and is parked:
    it waits there as a spare, past its quorum timeout, instead of failing and restarting."""
    run_dir = tmp_path / "run"
    timeout_s = 3.0
    args = [*PACE, "--quorum-timeout-s", str(timeout_s)]
    with Job(run_dir, replicas=2, steps=120, extra=["--hot-spares", "1"], train_args=args) as job:
        job.wait_for_step(1, 10)
        hung = job.pid(1)
        os.kill(hung, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while not any(q["members"] == [0, 2] for q in job.events("quorum")):
                assert time.monotonic() < deadline, "the spare never took the hung replica's place"
                time.sleep(0.2)
        finally:
            os.kill(hung, signal.SIGCONT)
        time.sleep(3 * timeout_s)
        exited = [e for e in job.events("process_exited") if e.get("pid") == hung]
        assert not exited, f"the resumed member did not wait parked: {exited}"
        assert job.pid(1) == hung, "the resumed member was restarted"
        assert job.wait(240) == 0
    finals = load_finals(run_dir, [0, 1, 2])
    assert set(finals) == {0, 2}
    assert_identical(finals)
