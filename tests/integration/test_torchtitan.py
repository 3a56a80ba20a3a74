"""torchtitan 0.3.0's fault-tolerance glue, unmodified, on unbroken through a ``kill -9``.

``make torchft-upstream`` unpacks the torchtitan wheel into ``.cache/upstream`` (never installed)
and the ``[torchft]`` extra brings what its modules import. The worker
(workers/torchtitan_ft.py) uses torchtitan's ``TorchFTManager`` (the FSDP2 all-reduce hook on
its ``ManagedProcessGroup``, the loss logged through functional collectives) on a small FSDP2
MLP: the Llama debug model and ``FaultTolerantTrainer`` itself are not run here (see
docs/torchtitan.md).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.integration.harness import ROOT, Job

pytestmark = [pytest.mark.integration, pytest.mark.scenario]

UPSTREAM = ROOT / ".cache" / "upstream"
WORKER = ROOT / "tests" / "integration" / "workers" / "torchtitan_ft.py"  # imports torchtitan: not here


def test_torchtitan_torchft_manager_survives_kill_9(tmp_path: Path) -> None:
    if not (UPSTREAM / "torchtitan" / "experiments" / "torchft" / "manager.py").exists():
        pytest.skip(f"torchtitan's wheel is not unpacked at {UPSTREAM}: run `make torchft-upstream`")
    pytest.importorskip("tyro", reason="the [torchft] extra is not installed: run `make torchft-upstream`")
    run_dir = tmp_path / "run"
    path = os.pathsep.join(filter(None, [str(ROOT), str(UPSTREAM), os.environ.get("PYTHONPATH", "")]))
    steps, at = 80, 6  # the restarted replica imports torch and torchtitan: it must find steps left
    with Job(
        run_dir,
        replicas=2,
        steps=steps,
        script=WORKER,
        extra=["--torchft-compat", "--min-replicas", "1", "--on-verdict", "ignore"],
        train_args=["--pace-s", "0.15"],
        env={"PYTHONPATH": path},
    ) as job:
        job.wait_for_step(1, at, timeout=120)
        os.kill(job.pid(1), signal.SIGKILL)
        assert job.wait(180) == 0
        states = job.final_states()
    assert states[0]["step"] == states[1]["step"] == steps
    for k, v in states[0]["model"].items():
        assert torch.equal(v, states[1]["model"][k]), k
    assert any(q["behind"] == [1] for q in job.events("quorum")), "the restarted replica never caught up"
    rows = [{r["step"]: r for r in job.metrics(i) if r["committed"]} for i in (0, 1)]
    both = rows[0].keys() & rows[1].keys()
    assert len(both) >= steps // 2
    for s in both:  # the loss logged through the managed group is the same on both replicas
        assert rows[0][s]["sum"] == rows[1][s]["sum"] and rows[0][s]["max"] == rows[1][s]["max"], s
