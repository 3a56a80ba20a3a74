"""unbroken inside a script written for torchrun: it sees torchrun's variables, keeps the
script's process group and SIGUSR1 handler, registers state after construction, writes
nothing into the working directory, and leaves the job cleanly through the context manager."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.integration.harness import Job

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "torchrun_style.py"
STEPS = 5


def test_a_torchrun_script_runs_under_unbroken_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run_dir = tmp_path / "run"
    with Job(run_dir, replicas=2, steps=STEPS, script=WORKER, extra=["--ranks-per-replica", "2"], train_args=[]) as job:
        assert job.wait(180) == 0
    assert list(cwd.iterdir()) == [], "something was written into the working directory"
    finished = {(e["replica"], e["rank"]) for e in job.events("replica_finished") if "rank" in e}
    assert finished == {(0, 0), (0, 1), (1, 0), (1, 1)}, "a rank did not leave the job as finished"
    weights = {}
    for replica in (0, 1):
        for rank in (0, 1):
            out = json.loads((run_dir / f"torchrun-r{replica}-rank{rank}.json").read_text())
            env = out["env"]
            assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
            assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["TORCHELASTIC_RESTART_COUNT"]) == ("2", "0", "0")
            assert env["TORCHELASTIC_RUN_ID"] == run_dir.name and env["MASTER_ADDR"] and env["MASTER_PORT"]
            assert out["same_group"], "unbroken replaced the script's process group"
            assert "already registered" in out["duplicate"]
            assert out["keys"] == ["data", "train"] and out["step"] == STEPS
            assert out["lr"] == pytest.approx(0.1 / (STEPS + 1)), "the scheduler did not drive the learning rate"
            assert out["caught"] == [int(signal.SIGUSR1)], "the script's own SIGUSR1 handler did not run"
            stack = (run_dir / "stacks" / f"r{replica}-rank{rank}.txt").read_text()
            assert "most recent call first" in stack, "no stack dump in the run directory"
            weights[(replica, rank)] = out["weight"]
    assert weights[(0, 0)] == weights[(1, 0)] and weights[(0, 1)] == weights[(1, 1)]
