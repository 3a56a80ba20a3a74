"""torchft's API on unbroken, in real replica processes launched with ``--torchft-compat``.

The worker (workers/torchft_train.py) imports only ``torchft``; each replica seeds its model
differently, so equal replicas at the end also show ``init_sync`` at work. A replica is killed
with ``kill -9`` in the middle of training; the survivor trains on, the supervisor restarts the
dead one, it catches up from its peer, and both end bitwise identical.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.integration.harness import ROOT, Job, assert_identical

pytestmark = pytest.mark.integration
WORKER = ROOT / "tests" / "integration" / "workers" / "torchft_train.py"  # imports torchft: not here
CALM = ["--on-verdict", "ignore"]


def _kill_run(tmp_path: Path, mode: str, steps: int, at: int, pace_s: float) -> tuple[Job, dict[int, dict]]:
    """Kills replica 1 at step ``at``; the steps left (at ``pace_s`` each) leave the restarted
    replica, a warm spare or a cold interpreter importing torch, time to rejoin and catch up."""
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=2,
        steps=steps,
        script=WORKER,
        extra=["--torchft-compat", "--min-replicas", "1", *CALM],
        train_args=["--mode", mode, "--pace-s", str(pace_s)],
    ) as job:
        job.wait_for_step(1, at, timeout=90)
        os.kill(job.pid(1), signal.SIGKILL)
        assert job.wait(150) == 0
        states = job.final_states()
    return job, states


def test_torchft_ddp_loop_survives_kill_9_and_replicas_end_identical(tmp_path: Path) -> None:
    job, states = _kill_run(tmp_path, "ddp", steps=60, at=6, pace_s=0.1)
    assert set(states) == {0, 1}
    assert_identical(states)
    assert states[0]["step"] == 60
    quorums = job.events("quorum")
    assert any(q["members"] == [0] for q in quorums), "the survivor never trained alone"
    assert any(q["behind"] == [1] for q in quorums), "the restarted replica never caught up"
    rows = job.metrics(0)
    assert rows[0]["torchft"] == "torchft" and rows[0]["participants"] == 2
    assert any(r["participants"] == 1 for r in rows), "no step counted one participant"


def _same_average_each_step(job: Job) -> set[int]:
    """Every step both replicas committed saw the same averaged gradient; returns those steps."""
    seen = [{r["committed_step"]: r["grad"] for r in job.metrics(i) if r["committed"]} for i in (0, 1)]
    both = seen[0].keys() & seen[1].keys()
    for s in both:
        assert seen[0][s] == seen[1][s], (s, seen[0][s], seen[1][s])
    return both


def test_torchft_manual_allreduce_loop_is_identical_without_a_shared_seed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=2,
        steps=6,
        script=WORKER,
        extra=["--torchft-compat", *CALM],
        train_args=["--mode", "allreduce", "--pace-s", "0"],
    ) as job:
        assert job.wait(90) == 0
        states = job.final_states()
    assert_identical(states)  # different seeds: init_sync made them equal at step 0
    rows = [job.metrics(0), job.metrics(1)]
    assert all(r["committed"] for r in rows[0] + rows[1])
    assert _same_average_each_step(job) == set(range(6))
    for a, b in zip(*rows, strict=True):  # the collectives after each step, on both replicas
        assert a["max"] == b["max"] == 1 + 10 * a["step"]
        assert a["mean_loss"] == b["mean_loss"]
        assert abs(a["mean_loss"] - (a["loss"] + b["loss"]) / 2) < 1e-5 * max(1.0, a["loss"])


def test_torchft_manual_allreduce_holds_the_average_in_a_catch_up_step(tmp_path: Path) -> None:
    # torchft's contract: after allreduce(t).wait(), t holds the average, in every step; the
    # restarted replica's first step is a catch-up step, where it contributes zeros.
    job, states = _kill_run(tmp_path, "allreduce", steps=60, at=5, pace_s=0.1)
    assert_identical(states)
    catch_up = [q for q in job.events("quorum") if q["behind"] == [1]]
    assert catch_up, "the restarted replica never caught up"
    both = _same_average_each_step(job)
    assert catch_up[0]["step"] in both and len(both) >= 20, (catch_up[0]["step"], sorted(both))


@pytest.mark.scenario  # 21 s; DiLoCo's logic is in tests/unit/torchft, torchft's own DiLoCo tests under scenarios too
def test_torchft_diloco_survives_kill_9_and_replicas_end_identical(tmp_path: Path) -> None:
    job, states = _kill_run(tmp_path, "diloco", steps=30, at=3, pace_s=0.1)
    assert set(states) == {0, 1}
    assert states[0]["step"] == states[1]["step"] == 30  # outer syncs
    for k, v in states[0]["model"].items():  # the inner optimizers' state is each replica's own
        assert torch.equal(v, states[1]["model"][k]), k
    assert any(q["behind"] == [1] for q in job.events("quorum")), "the restarted replica never caught up"
