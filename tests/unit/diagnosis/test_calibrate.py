"""Thresholds read off measured distributions, and the step-time rule's pure parts."""

from __future__ import annotations

import math
import random

import pytest

from unbroken.diagnosis.master.master import DiagnosisMaster
from unbroken.diagnosis.rules import calibrate, links, steptime


def test_held_is_the_lowest_score_of_each_run_of_confirm() -> None:
    assert calibrate.held([1.0, 1.4, 1.3, 1.5, 1.0], 2) == [1.0, 1.3, 1.3, 1.0]
    assert calibrate.held([1.0, 2.0], 3) == []
    with pytest.raises(ValueError):
        calibrate.held([1.0], 0)


def test_one_noisy_collective_does_not_make_a_held_score() -> None:
    # A single burst at 1.6 among healthy 1.0s: held over 3 collectives it never passes 1.0.
    assert max(calibrate.held([1.0] * 5 + [1.6] + [1.0] * 5, 3)) == 1.0


def test_threshold_is_the_geometric_middle_of_worst_healthy_and_weakest_fault() -> None:
    assert calibrate.separating_threshold([0.9, 1.1, 1.2], [1.5, 3.0]) == pytest.approx(math.sqrt(1.2 * 1.5))


def test_no_threshold_when_the_distributions_overlap() -> None:
    assert calibrate.separating_threshold([1.0, 1.4], [1.3, 2.0]) is None
    assert calibrate.separating_threshold([], [2.0]) is None
    assert calibrate.separating_threshold([1.0], []) is None


def test_calibration_reports_margins_of_the_threshold_in_use() -> None:
    got = calibrate.calibration([1.0, 1.2], [1.8], configured=1.5)
    assert got["derived_threshold"] == pytest.approx(math.sqrt(1.2 * 1.8), abs=1e-4)
    assert (got["margin_over_healthy"], got["margin_under_fault"]) == (1.25, 1.2)
    assert got["healthy"]["n"] == 2 and got["faulty"]["max"] == 1.8


def test_shift_score_needs_the_fastest_quarter_to_move_too() -> None:
    base = [0.1] * 20
    steady = base + [0.13] * 10
    bursty = base + [0.13, 0.1] * 4 + [0.13] * 2  # a hog: some steps slow, some as fast as ever
    assert steptime.shift_score(steady, 10, 16) == pytest.approx(1.3)
    assert steptime.median_ratio(bursty, 10, 16) == pytest.approx(1.3)
    assert steptime.shift_score(bursty, 10, 16) == pytest.approx(1.0)
    assert steptime.shift_score(base, 10, 16) is None  # windows not full


def test_gated_score_is_zero_unless_alone_and_the_pace_moved() -> None:
    base = [0.1] * 20
    slow = base + [0.13] * 10
    cadence = [0.12] * 20 + [0.15] * 10
    alone = {0: slow, 1: base + [0.1] * 10, 2: base + [0.1] * 10}
    assert steptime.gated_score(0, alone, cadence, 10, 16) == pytest.approx(1.3)
    shared = {0: slow, 1: slow, 2: base + [0.1] * 10}  # the machine, not a replica
    assert steptime.gated_score(0, shared, cadence, 10, 16) == 0.0
    same_pace = [0.12] * 30  # its waits shrank by as much: the job is as fast as ever
    assert steptime.gated_score(0, alone, same_pace, 10, 16) == 0.0


def test_link_scores_are_what_classify_slow_compares_with_its_ratio() -> None:
    rng = random.Random(3)
    cells = {}
    for a, b in [(0, 1), (1, 0), (1, 2), (2, 1), (0, 2), (2, 0)]:
        slow = 20.0 if {a, b} == {0, 2} else 1.0
        cells[(a, b)] = [slow * rng.uniform(0.9, 1.1) for _ in range(16)]
    scores = links.link_scores(cells, min_samples=12)
    assert scores[(0, 2)] > 15 and max(scores[(0, 1)], scores[(1, 2)]) < 1.0
    f = links.classify_slow(cells, ratio=2.5, min_samples=12)
    assert f is not None and f.link == (0, 2)
    assert f.evidence["scores"]["0-2"] == pytest.approx(scores[(0, 2)], abs=0.01)


def test_master_hands_its_scores_at_each_new_collective() -> None:
    from tests.unit.diagnosis.test_master import run_steps

    got: list[dict] = []
    m = DiagnosisMaster()
    m.on_scores = lambda s: got.append({k: dict(v) for k, v in s.items()})
    run_steps(m, range(40), {0: 0.1, 1: 0.1, 2: 0.1})
    assert len(got) >= 35  # once per new collective, not per evaluation
    last = got[-1]
    assert set(last["straggler"]) == {"0/0", "1/0", "2/0"} and set(last["step_time"]) == {"0/0", "1/0", "2/0"}
    assert all(abs(x - 1.0) < 0.05 for x in last["straggler"].values())


def test_step_time_threshold_sits_between_the_recorded_healthy_worst_and_fault_median() -> None:
    # The figures at steptime.STEP_TIME_THRESHOLD: healthy worst 1.15 (load 11), 1.3x fault held
    # 1.17, 1.85, 2.10. The weakest fault may overlap the load-11 run (1.15 to 1.265); the median does not.
    assert calibrate.separating_threshold([1.074, 1.15], [1.17, 1.85, 2.10]) is not None  # 1.17 > 1.15, barely
    assert calibrate.separating_threshold([1.074, 1.15, 1.265], [1.17, 1.85, 2.10]) is None  # the old rule's median
    middle = calibrate.separating_threshold([1.15], [1.85])
    assert middle is not None and 1.15 * 1.2 < steptime.STEP_TIME_THRESHOLD <= middle
