"""A replica named for corruption twice within the window is a hardware suspect, once."""

from __future__ import annotations

import pytest

from unbroken.diagnosis.rules.suspect import KEPT_STEPS, SuspectTracker
from unbroken.diagnosis.verdict import SUSPECT_HARDWARE


def test_a_second_finding_within_the_window_makes_a_suspect_once() -> None:
    t = SuspectTracker(window_steps=100)
    assert t.observe([1], 10) == []
    assert t.observe([1], 10) == []  # the same finding told by another member
    assert t.observe([2], 20) == []  # another replica's first
    [v] = t.observe([1], 60)
    assert v.kind == SUSPECT_HARDWARE and v.culprit.replica == 1 and v.evidence["sdc_steps"] == [10, 60]
    assert t.observe([1], 70) == []  # reported already within this window
    assert t.observe([1], 200) == []  # alone in its window: 70 is 130 steps back
    assert [v.culprit.replica for v in t.observe([1], 250)] == [1]  # a new window


def test_findings_further_apart_than_the_window_are_not_a_suspect() -> None:
    t = SuspectTracker(window_steps=10)
    assert t.observe([0], 5) == [] and t.observe([0], 50) == [] and t.observe([0], 100) == []


def test_memory_is_bounded() -> None:
    t = SuspectTracker(window_steps=1)
    for s in range(0, 1000, 5):
        t.observe([3], s)
    assert len(t._named[3]) == KEPT_STEPS
    with pytest.raises(ValueError, match="window_steps"):
        SuspectTracker(0)
