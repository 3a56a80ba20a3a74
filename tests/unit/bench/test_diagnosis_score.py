from __future__ import annotations

import pytest

from unbroken.bench.network.diagnosis import SCENARIOS, Scenario, score

STRAGGLER = Scenario(
    "s", "slow_rank", 100, ("slow_rank:replica=0,factor=2,step=40",), expect=frozenset({"straggler"}), culprit=0
)
LINK = Scenario("l", "link_slow", 100, expect=frozenset({"comm_slow"}), culprit=(0, 2), onset_step=40)


def rows(n: int, t0: float = 100.0) -> list[dict]:
    return [{"t": t0 + s, "step": s, "committed": True, "step_s": 1.0} for s in range(n)]


def verdict(t: float, cls: str, replica: int, link: list[int] | None = None) -> dict:
    return {"kind": "verdict", "t": t, "class": cls, "culprit": {"replica": replica, "link": link}}


def test_first_verdict_after_onset_is_judged_and_earlier_ones_are_false_positives() -> None:
    events = [verdict(120.0, "straggler", 1), {"kind": "fault_injected", "t": 140.0}, verdict(151.5, "straggler", 0)]
    r = score(STRAGGLER, events, rows(60))
    assert (r["detected"], r["culprit_correct"], r["class_correct"]) == (True, True, True)
    assert r["detect_s"] == pytest.approx(11.5)
    assert r["detect_steps"] == 11
    assert r["false_positives"] == 1


def test_wrong_culprit_or_class_is_reported_as_such() -> None:
    events = [{"kind": "fault_injected", "t": 140.0}, verdict(145.0, "metric_anomaly", 2)]
    r = score(STRAGGLER, events, rows(60))
    assert r["detected"] and not r["culprit_correct"] and not r["class_correct"]


def test_missed_fault() -> None:
    r = score(STRAGGLER, [{"kind": "fault_injected", "t": 140.0}], rows(60))
    assert r["detected"] is False and r["detect_s"] is None


def test_link_fault_onset_comes_from_the_steps_and_the_link_must_match() -> None:
    good = score(LINK, [verdict(143.0, "comm_slow", 2, [2, 0])], rows(60))
    assert good["culprit_correct"] and good["detect_s"] == pytest.approx(3.0)
    bad = score(LINK, [verdict(143.0, "comm_slow", 0, [0, 1])], rows(60))
    assert not bad["culprit_correct"]


def test_clean_run_counts_every_verdict() -> None:
    clean = Scenario("c", "clean", 100)
    r = score(clean, [verdict(110.0, "straggler", 1), verdict(130.0, "comm_slow", 0)], rows(60))
    assert r["false_positives"] == 2 and r["detected"] is None and r["steps"] == 60


def test_crash_is_detected_by_the_process_exit() -> None:
    crash = next(s for s in SCENARIOS if s.name == "crash")
    events = [{"kind": "fault_injected", "t": 140.0}, {"kind": "process_exited", "t": 140.02, "replica": 1, "rank": 0}]
    r = score(crash, events, rows(60))
    assert r["detected"] and r["culprit_correct"] and r["class_correct"]


def test_scenario_suite_covers_the_issue() -> None:
    kinds = {s.kind for s in SCENARIOS}
    assert {"crash", "hang", "link_stall", "slow_rank", "link_slow", "node_slow", "nan_loss", "clean"} <= kinds
    assert sum(s.steps for s in SCENARIOS if s.clean) >= 1000
    assert any(s.hog for s in SCENARIOS if s.clean)


def test_overhead_ratio_is_paired_so_drifting_load_cancels() -> None:
    from unbroken.bench.network.diagnosis import paired_ratio

    # Load doubles between the first and the second pair; within each pair the recorder costs 1%.
    pairs = [([1.01] * 5, [1.0] * 5), ([2.02] * 5, [2.0] * 5), ([1.01] * 3, [1.0] * 3)]
    assert paired_ratio(pairs) == pytest.approx(1.01)
    assert paired_ratio([([], [1.0])]) is None


def test_recorder_cost_is_timed_per_thread() -> None:
    from unbroken.bench.network.diagnosis import recorder_cost_us

    cost = recorder_cost_us(n=50)
    assert set(cost) == {"training_thread", "ring_transfers", "batch"} and all(v > 0 for v in cost.values())


def test_hogs_are_real_busy_processes_and_end_by_their_pids() -> None:
    import time

    from unbroken.bench.network.diagnosis import start_hogs, stop_hogs

    hogs = start_hogs(2)
    try:
        assert len({h.pid for h in hogs}) == 2
        time.sleep(0.3)
        assert all(h.poll() is None for h in hogs), "a hog exited by itself"
    finally:
        stop_hogs(hogs)
    assert all(h.poll() is not None for h in hogs)
