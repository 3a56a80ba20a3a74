"""``unbroken.DistributedDataParallel`` in real replica processes: equal to plain torch, and
faults in the middle of the bucketed exchange leave every replica identical."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.harness import Job, assert_identical
from tests.integration.workers import ddp_train as w

pytestmark = pytest.mark.integration
WORKER = Path(w.__file__)
# The diagnosis must not restart a replica that a loaded machine slows down: these tests inject
# their own faults and compare against a run without any.
CALM = ["--on-verdict", "ignore"]


def reference(steps: int, replicas: int) -> dict[str, torch.Tensor]:
    """One process: average both replicas' accumulated gradients, clip, step AdamW and the schedule."""
    net = w.build_model()
    opt, sched = w.build_optimizer(net)
    for step in range(steps):
        grads = []
        for r in range(replicas):
            net.zero_grad()
            for micro in range(w.MICRO):
                x, y = w.batch(step, r, micro)
                torch.nn.functional.mse_loss(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *gs in zip(net.parameters(), *grads, strict=False):
            p.grad = torch.mul(sum(gs[1:], gs[0]), 1.0 / replicas)
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), w.MAX_NORM)
        assert norm > w.MAX_NORM, "the test must clip"
        opt.step()
        sched.step()
    return net.state_dict()


def test_ddp_equals_single_process_reference(tmp_path: Path) -> None:
    steps = 8
    run_dir = tmp_path / "run"
    with Job(run_dir, replicas=2, steps=steps, script=WORKER, train_args=[], extra=CALM) as job:
        assert job.wait(120) == 0
        states = job.final_states()
    assert_identical(states)
    want = reference(steps, 2)
    for k, v in want.items():
        torch.testing.assert_close(states[0]["model"][k], v, rtol=1e-6, atol=1e-6)
    rows = [json.loads(line) for line in (run_dir / "metrics-r0.jsonl").read_text().splitlines()]
    assert all(r["committed"] and r["members"] == [0, 1] for r in rows), rows


def _fault_run(tmp_path: Path, kind: str, extra: list[str]) -> tuple[Job, dict[int, dict]]:
    steps, at = 60, 12
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=2,
        steps=steps,
        script=WORKER,
        extra=["--min-replicas", "1", *CALM, *extra],
        train_args=["--pace-s", "0.12", "--fault", kind, "--fault-step", str(at)],
    ) as job:
        marker = run_dir / "fault-r1.json"
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert time.monotonic() < deadline and job.proc.poll() is None, "the fault never fired"
            time.sleep(0.05)
        time.sleep(0.1)  # the file is written just before the signal
        fault = json.loads(marker.read_text())
        if kind == "stop":
            job.wait_for_step(0, at + 8, timeout=60)  # the survivor moves on without it
            os.kill(fault["pid"], signal.SIGCONT)
        assert job.wait(180) == 0
        states = job.final_states()
    assert 0 < fault["buckets_started"], fault
    return job, states


def test_kill_9_inside_the_bucketed_exchange(tmp_path: Path) -> None:
    job, states = _fault_run(tmp_path, "kill", [])
    assert set(states) == {0, 1}
    assert_identical(states)
    quorums = job.events("quorum")
    assert any(q["members"] == [0] for q in quorums), "the survivor never trained alone"
    assert any(q["behind"] == [1] for q in quorums), "the restarted replica never caught up"


def test_sigstop_inside_the_bucketed_exchange(tmp_path: Path) -> None:
    job, states = _fault_run(tmp_path, "stop", ["--on-hang", "wait"])
    assert set(states) == {0, 1}, "the resumed replica should rejoin and finish"
    assert_identical(states)
    quorums = job.events("quorum")
    assert any(q["members"] == [0] for q in quorums), "the survivor never trained without the hung replica"
    assert any(q["behind"] == [1] for q in quorums), "the resumed replica never caught up"


def test_hsdp_process_group_equals_single_process_reference(tmp_path: Path) -> None:
    """FSDP2 over 2 ranks per replica, its all-reduce hook on ``manager.process_group()``."""
    steps, replicas, ranks = 6, 2, 2
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=replicas,
        steps=steps,
        script=WORKER.parent / "hsdp_train.py",
        train_args=[],
        extra=["--ranks-per-replica", str(ranks), *CALM],
    ) as job:
        assert job.wait(150) == 0
    shards = {
        (r, k): torch.load(run_dir / f"final-r{r}-rank{k}.pt", weights_only=False)
        for r in range(replicas)
        for k in range(ranks)
    }
    assert all(s["step"] == steps for s in shards.values())
    for k in range(ranks):  # both replicas hold the same shards
        for name, v in shards[(0, k)]["model"].items():
            assert torch.equal(v, shards[(1, k)]["model"][name]), (k, name)
    net = w.build_model()
    opt, sched = w.build_optimizer(net)
    for step in range(steps):
        replica_means = []
        for r in range(replicas):
            per_rank = []
            for k in range(ranks):
                net.zero_grad()
                x, y = w.batch(step, r, k)
                torch.nn.functional.mse_loss(net(x), y).backward()
                per_rank.append([p.grad.clone() for p in net.parameters()])
            replica_means.append([torch.mul(sum(gs[1:], gs[0]), 1.0 / ranks) for gs in zip(*per_rank, strict=False)])
        for p, *gs in zip(net.parameters(), *replica_means, strict=False):
            p.grad = torch.mul(sum(gs[1:], gs[0]), 1.0 / replicas)
        assert torch.nn.utils.clip_grad_norm_(net.parameters(), w.MAX_NORM) > w.MAX_NORM
        opt.step()
        sched.step()
    for name, v in net.state_dict().items():
        got = torch.cat([shards[(0, k)]["model"][name] for k in range(ranks)])
        torch.testing.assert_close(got, v, rtol=1e-6, atol=1e-6)


@pytest.mark.scenario
def test_hsdp_kill_9_inside_the_process_group_all_reduce(tmp_path: Path) -> None:
    """A rank dies inside FSDP's all-reduce hook: the survivors' step fails cleanly and is redone
    without it, its replica group restarts and catches up, and every shard ends identical."""
    steps, at = 90, 8  # the restarted group (4 processes importing torch on 2 cores) must find steps left
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=2,
        steps=steps,
        script=WORKER.parent / "hsdp_train.py",
        train_args=["--pace-s", "0.2", "--fault-step", str(at)],
        extra=["--ranks-per-replica", "2", "--min-replicas", "1", *CALM],
    ) as job:
        assert job.wait(180) == 0
    fault = json.loads((run_dir / "fault.json").read_text())
    assert fault["step"] == at and fault["all_reduces"] >= 1, fault
    quorums = job.events("quorum")
    assert any(q["members"] == [0] for q in quorums), "replica 0 never trained alone"
    assert any(q["behind"] == [1] for q in quorums), "the restarted replica group never caught up"
    rows = [json.loads(line) for line in (run_dir / "metrics-r0.jsonl").read_text().splitlines()]
    assert any(r["step"] == at and not r["committed"] for r in rows), "the interrupted step was not failed"
    for k in range(2):
        a = torch.load(run_dir / f"final-r0-rank{k}.pt", weights_only=False)
        b = torch.load(run_dir / f"final-r1-rank{k}.pt", weights_only=False)
        assert a["step"] == b["step"] == steps
        for name, v in a["model"].items():
            assert torch.equal(v, b["model"][name]), (k, name)
        for i, st in a["optim"].items():
            for name, v in st.items():
                assert torch.equal(v, b["optim"][i][name]), (k, i, name)
