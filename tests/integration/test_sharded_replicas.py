"""Replica groups of several ranks, each sharding its model with FSDP2 (the HSDP shape).

A crash of one rank takes its whole replica group down (its siblings are stuck in
collectives with it); the group restarts and every rank catches up its own shards from the
same rank of a donor replica.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.integration.harness import Job, metrics

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "fsdp_train.py"
STEPS = 70
COLD_START_S = 4.0


def test_crash_of_one_rank_in_a_sharded_replica(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=2,
        steps=STEPS,
        script=WORKER,
        extra=["--ranks-per-replica", "2", "--min-replicas", "1"],
        train_args=["--pace-s", "0.2", "--restarted-first-step-s", str(COLD_START_S)],
    ) as job:
        job.wait_for_step(1, 10)
        victim = [e["pid"] for e in job.events("process_started") if e["replica"] == 1 and e["rank"] == 1][-1]
        os.kill(victim, signal.SIGKILL)
        assert job.wait(240) == 0
    quorums = job.events("quorum")
    assert any(q["members"] == [0] for q in quorums), "replica 0 never trained alone"
    assert any(q["behind"] == [1] for q in quorums), "the restarted replica group never caught up"
    for rank in (0, 1):
        a = torch.load(run_dir / f"final-r0-rank{rank}.pt", weights_only=False)
        b = torch.load(run_dir / f"final-r1-rank{rank}.pt", weights_only=False)
        assert a["step"] == b["step"] == STEPS
        for k, v in a["model"].items():
            assert torch.equal(v, b["model"][k]), f"rank {rank} shard of {k} differs between replicas"
        for i, st in a["optim"].items():
            for k, v in st.items():
                assert torch.equal(v, b["optim"][i][k]), f"rank {rank} optimizer {i}.{k} differs"
    # The restarted group's first step is slow (a cold start); it catches up in that step with a
    # zero gradient, which it sends without waiting for its own forward and backward pass.
    catch_up = [r for r in metrics(run_dir, 0) if r["behind"] == [1]]
    assert catch_up and max(r["step_s"] for r in catch_up) < COLD_START_S / 2, catch_up
    # The two ranks of a replica hold different shards: the exchange really was per shard.
    r0, r1 = (torch.load(run_dir / f"final-r0-rank{k}.pt", weights_only=False) for k in (0, 1))
    assert not all(torch.equal(v, r1["model"][k]) for k, v in r0["model"].items())
