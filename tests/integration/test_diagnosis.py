"""Diagnosis on a real job: the coordinator's master names a slow replica, and stays quiet on a clean run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.harness import Job

pytestmark = pytest.mark.integration


def test_slow_rank_gets_a_straggler_verdict_naming_it(tmp_path: Path) -> None:
    # No pacing: a paced step would absorb the injected slowness in its sleep.
    extra = ["--on-verdict", "ignore", "--fault", "slow_rank:replica=2,factor=3,step=20"]
    with Job(tmp_path / "run", replicas=3, steps=200, extra=extra, train_args=[]) as job:
        deadline = time.monotonic() + 50
        verdicts: list[dict] = []
        while time.monotonic() < deadline and not verdicts:
            time.sleep(0.5)
            verdicts = job.events("verdict")
            assert job.proc.poll() is None, "the job ended before any verdict"
    assert verdicts, "no verdict within 50 s of the start"
    first = verdicts[0]
    assert first["class"] == "straggler", first
    assert first["culprit"]["replica"] == 2, first
    assert first["evidence"]["detector"] == "unbroken.diagnosis"
    injected = job.events("fault_injected")
    assert injected and injected[0]["t"] <= first["t"], "a straggler was named before the fault began"


# A clean run emits no verdict: test_fault_tolerance.py::test_a_clean_run_gets_no_verdict (its
# fault-free reference run is that check too).
