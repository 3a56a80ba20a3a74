"""Silent data corruption, in real processes: a flipped bit is caught, named and healed.

No process is killed: one replica's exchange result, then another replica's weight, then the
first one's result again get a bit flipped (``--fault bitflip``). The verified exchange must see
each (a result in the step it happens, the weight at the next weight check), name the replica,
keep every replica from
committing a differing sum, and repair the corrupted replica from a healthy peer by catch-up
(no restart): at the end every replica holds the same bytes. The replica named twice is reported
as suspect hardware and set aside: its node is isolated and it moves to the spare slot.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from tests.integration.harness import Job, assert_identical

pytestmark = pytest.mark.integration
STEPS = 40
WEIGHT_EVERY = 4


def committed_fingerprints(job: Job) -> dict[int, set[int]]:
    """step -> the exchange fingerprints the replicas committed it with."""
    out: dict[int, set[int]] = defaultdict(set)
    for r in range(job.replicas):
        for row in job.metrics(r):
            if row.get("committed") and row.get("exchange_fp"):
                out[row["step"]].add(row["exchange_fp"])
    return out


def test_flipped_bits_in_a_result_and_a_weight_are_caught_named_and_repaired(tmp_path: Path) -> None:
    faults = [
        "--fault",
        "bitflip:replica=1,step=6,where=result,bit=30",
        "--fault",
        "bitflip:replica=2,step=9,where=weight,bit=12",
        "--fault",
        "bitflip:replica=1,step=14,where=result,bit=3",
    ]
    with Job(
        tmp_path / "run",
        steps=STEPS,
        extra=[*faults, "--spares", "1"],
        train_args=["--pace-s", "0.05"],
        env={"UNBROKEN_WEIGHT_CHECK_EVERY": str(WEIGHT_EVERY)},
    ) as job:
        assert job.wait(180) == 0
        states = job.final_states()
    assert set(states) == {0, 1, 2} and states[0]["step"] == STEPS
    assert_identical(states)
    logs = {r: (tmp_path / "run" / "logs" / f"replica{r}-rank0.log").read_text() for r in range(3)}
    # The result flip is seen by every member in step 6 and blamed on replica 1, which alone
    # does not commit; the weight flip (step 9) at the next weight check, blamed on replica 2.
    for r in range(3):
        assert "step 6: silent data corruption: the exchange's results differ" in logs[r], r
        assert "culprit [1]" in logs[r] and "culprit [2]" in logs[r], r
    assert "silent data corruption: the weights differ" in logs[0]
    assert "culprit [1]; not committing this step" in logs[1]
    assert "culprit [2]; not committing this step" in logs[2]
    # Healed by catch-up from a healthy peer, not by a restart: the one restart is replica 1's
    # move to the spare slot once it is a suspect (below).
    caught = {e["replica"] for e in job.events("caught_up")}
    assert {1, 2} <= caught, job.events("caught_up")
    starts = [(e["replica"], e["node"]) for e in job.events("process_started")]
    assert sorted(r for r, _ in starts) == [0, 1, 1, 2], starts
    assert starts[-1][0] == 1 and starts[-1][1] not in {n for _, n in starts[:-1]}, starts
    # No step was committed with differing sums, and every step was verified somewhere.
    fps = committed_fingerprints(job)
    assert all(len(v) == 1 for v in fps.values()), {s: v for s, v in fps.items() if len(v) > 1}
    assert set(range(STEPS)) - set(fps) == set()
    # Each finding reached the coordinator's event log; replica 1, named twice, is a suspect.
    found = {(e["step"], e["what"], tuple(e["culprits"])) for e in job.events("sdc_detected")}
    assert {(6, "results", (1,)), (14, "results", (1,))} <= found, found
    assert any(what == "weights" and culprits == (2,) for _, what, culprits in found), found
    suspects = [v for v in job.events("verdict") if v["class"] == "suspect_hardware"]
    assert [v["culprit"]["replica"] for v in suspects] == [1], suspects
    isolated = job.events("node_isolated")
    assert [(e["replica"], e["reason"]) for e in isolated] == [(1, "diagnosis verdict: suspect_hardware")], isolated
