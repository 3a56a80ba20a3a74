"""Under ``constant_global_batch`` a run through a kill -9 and a SIGSTOP trains every sample of the
fault-free run exactly once, in the same steps, and ends where the fault-free run ends."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.harness import Job, assert_identical
from tests.integration.workers import data_accounting as w

pytestmark = pytest.mark.integration
WORKER = Path(w.__file__)
REPLICAS, STEPS, KILL_AT, STOP_AT = 3, 36, 5, 16


def fault_free_reference(steps: int) -> dict[str, torch.Tensor]:
    """One process: each step's gradient is the mean over all slots of the step."""
    net = w.build_model()
    opt = w.build_optimizer(net)
    per_step = REPLICAS * w.PER_REPLICA
    for step in range(steps):
        opt.zero_grad()
        for slot in range(REPLICAS):
            start = step * per_step + slot * w.PER_REPLICA
            x, y = w.samples(list(range(start, start + w.PER_REPLICA)))
            (torch.nn.functional.mse_loss(net(x), y) / REPLICAS).backward()
        opt.step()
    return net.state_dict()


def wait_for(path: Path, job: Job, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline and job.proc.poll() is None, f"{path.name} never appeared"
        time.sleep(0.05)
    time.sleep(0.1)  # written just before the signal
    return json.loads(path.read_text())


def test_constant_global_batch_consumes_every_sample_exactly_once_through_kill_and_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=REPLICAS,
        steps=STEPS,
        script=WORKER,
        train_args=["--pace-s", "0.1", "--kill-step", str(KILL_AT), "--stop-step", str(STOP_AT)],
        extra=["--min-replicas", "1", "--on-verdict", "ignore", "--on-hang", "wait"],
    ) as job:
        wait_for(run_dir / "fault-r1.json", job)
        stopped = wait_for(run_dir / "fault-r2.json", job)
        job.wait_for_step(0, STOP_AT + 5, timeout=60)  # the others move on without the hung replica
        os.kill(stopped["pid"], signal.SIGCONT)
        assert job.wait(120) == 0
        states = job.final_states()
    assert set(states) == {0, 1, 2}
    assert_identical(states)

    rows = [
        json.loads(line) for r in range(REPLICAS) for line in (run_dir / f"metrics-r{r}.jsonl").read_text().splitlines()
    ]
    consumed = Counter(i for r in rows for i in r["ids"])
    everything = range(STEPS * REPLICAS * w.PER_REPLICA)
    assert sorted(consumed) == list(everything), "some sample of the fault-free run was never trained"
    assert max(consumed.values()) == 1, f"samples trained twice: {[i for i, n in consumed.items() if n > 1][:10]}"
    # Each sample in its fault-free step, whoever trained it.
    assert all(i // (REPLICAS * w.PER_REPLICA) == r["step"] for r in rows for i in r["ids"])
    # The faults really took replicas out: steps ran short-handed, and both victims caught up.
    assert any(len(r["members"]) - len(r["behind"]) < REPLICAS for r in rows)
    caught_up = {b for r in rows for b in r["behind"]}
    assert caught_up >= {1, 2}, caught_up
    last = [r["account"] for r in rows if r["step"] == STEPS - 1]
    assert len(last) == REPLICAS and all(a == last[0] for a in last)
    assert (last[0]["samples_skipped"], last[0]["samples_repeated"]) == (0, 0)
    assert last[0]["samples_trained"] == len(everything)
    # The same samples in the same steps with the same global batch: the fault-free run's model.
    for k, v in fault_free_reference(STEPS).items():
        torch.testing.assert_close(states[0]["model"][k], v, rtol=1e-4, atol=1e-5)
