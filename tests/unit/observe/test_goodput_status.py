"""Goodput accounting, the stand-in straggler check and the status rows, on hand-made runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.control.status import status_rows
from unbroken.observe.events import EventLog
from unbroken.observe.goodput import account, detections
from unbroken.observe.live import JobView
from unbroken.observe.schema import ReplicaState


def _rows(replica: int, steps: range, t0: float, step_s: float, committed: bool = True) -> list[dict]:
    return [
        {
            "replica": replica,
            "step": s,
            "t": t0 + (i + 1) * step_s,
            "step_s": step_s,
            "committed": committed,
            "loss": 1.0,
        }
        for i, s in enumerate(steps)
    ]


def test_a_fault_free_run_has_full_goodput() -> None:
    events = [{"t": 0.0, "kind": "quorum", "members": [0, 1], "behind": []}]
    metrics = {r: _rows(r, range(10), 0.0, 1.0) for r in (0, 1)}
    g = account(events, metrics, 2)
    assert g.goodput == pytest.approx(1.0)
    assert g.lost_s["recovery"] == 0 and g.lost_s["detection"] == 0


def test_a_crashed_replica_costs_detection_and_recovery() -> None:
    events = [
        {"t": 0.0, "kind": "quorum", "members": [0, 1], "behind": []},
        {"t": 0.0, "kind": "replica_state", "replica": 0, "new": "training"},
        {"t": 0.0, "kind": "replica_state", "replica": 1, "new": "training"},
        {"t": 4.0, "kind": "fault_injected", "replica": 1, "fault_kind": "crash", "target": "replica 1"},
        {"t": 4.5, "kind": "process_exited", "replica": 1, "rank": 0},
        {"t": 4.5, "kind": "replica_state", "replica": 1, "new": "failed"},
        {"t": 5.0, "kind": "replica_state", "replica": 1, "new": "recovering"},
        {"t": 8.0, "kind": "replica_state", "replica": 1, "new": "catching_up"},
        {"t": 9.0, "kind": "replica_state", "replica": 1, "new": "training"},
    ]
    metrics = {0: _rows(0, range(10), 0.0, 1.0), 1: _rows(1, range(4), 0.0, 1.0) + _rows(1, range(9, 10), 9.0, 1.0)}
    g = account(events, metrics, 2)
    assert g.productive_s == pytest.approx(15.0)  # 10 + 5 committed steps of 1 s
    assert g.goodput == pytest.approx(15 / 20)
    assert g.lost_s["detection"] == pytest.approx(0.5 * 2)
    assert g.lost_s["recovery"] == pytest.approx(3.5)
    assert g.lost_s["catch_up"] == pytest.approx(1.0)
    [(fault, hit)] = detections(events)
    assert hit is not None and hit["kind"] == "process_exited"


def test_a_killed_coordinator_is_detected_by_its_restart_and_recovered_once_it_serves_an_epoch() -> None:
    from unbroken.launch.run.demo import fault_outcomes

    events = [
        {"t": 0.0, "kind": "quorum", "epoch": 3, "members": [0, 1], "behind": []},
        {"t": 4.0, "kind": "fault_injected", "fault_kind": "coordinator_kill", "target": "coordinator", "rank": 0},
        {"t": 5.0, "kind": "coordinator_restarted", "continue_after_epoch": 1000},
        {"t": 5.0, "kind": "epoch_resumed", "epoch": 3, "step": 20, "members": [0, 1], "window_s": 20.0},
    ]
    [row] = fault_outcomes(events)
    assert row["detected"] and row["recovered"] and row["detect_s"] == 1.0
    assert row["detected_by"] == "coordinator_restarted"
    [row] = fault_outcomes(events[:3])  # restarted, but never served an epoch again
    assert row["detected"] and not row["recovered"]


def test_a_flipped_bit_is_detected_by_the_finding_that_names_it_and_recovered_by_its_catch_up() -> None:
    from unbroken.launch.run.demo import fault_outcomes

    events = [
        {"t": 0.0, "kind": "quorum", "epoch": 1, "members": [0, 1, 2], "behind": []},
        {"t": 4.0, "kind": "fault_injected", "replica": 0, "fault_kind": "bitflip", "target": "replica 0"},
        # Every member reports the finding; the first that names replica 0 detects it.
        {"t": 4.1, "kind": "sdc_detected", "replica": 2, "rank": 0, "step": 9, "culprits": [0], "committed": True},
        {"t": 4.1, "kind": "caught_up", "replica": 1, "rank": 0, "step": 9, "seconds": 0.1, "nbytes": 1},
        {"t": 4.3, "kind": "caught_up", "replica": 0, "rank": 0, "step": 10, "seconds": 0.1, "nbytes": 1},
    ]
    [row] = fault_outcomes(events)
    assert row["detected"] and row["attributed_correctly"] and row["recovered"]
    assert row["detected_by"] == "sdc_detected" and row["detect_s"] == pytest.approx(0.1)
    [row] = fault_outcomes(events[:4])  # another replica's catch-up is not this one's repair
    assert row["detected"] and not row["recovered"]
    wrong = [*events[:2], {**events[2], "culprits": [1]}]
    [row] = fault_outcomes(wrong)  # a finding that names someone else does not detect it
    assert not row["detected"]


def test_status_rows_join_the_coordinator_and_the_typed_events(tmp_path: Path) -> None:
    status = {
        "epoch": 4,
        "members": [0, 1],
        "replicas": {"0": {"step": 7, "node": "a", "compute_s": 0.2}, "1": {"step": 7, "node": "b"}},
    }
    log = EventLog(tmp_path / "events.jsonl", "launcher")
    log.emit(ReplicaState(replica=1, old="recovering", new="catching_up", reason="joined behind"))
    log.emit(ReplicaState(replica=2, old="training", new="failed", reason="exit -9"))
    log.close()
    view = JobView(tmp_path)
    view.refresh()
    rows = status_rows(status, view)
    assert [(r["replica"], r["state"], r["epoch"], r["step"]) for r in rows] == [
        (0, "member", 4, 7),
        (1, "catching_up", 4, 7),
        (2, "failed", None, None),
    ]
    assert rows[2]["last_event"] == "failed: exit -9"
