from __future__ import annotations

from unbroken.control.quorum.setaside import SetAside


def test_a_replica_whose_epochs_keep_failing_is_set_aside_the_last_to_join_first() -> None:
    s = SetAside(after_failures=2, hold_s=10.0)
    s.formed(1, [0, 2])
    s.formed(2, [0, 1, 2])  # 1 came back last
    assert s.failed(2, [0, 1, 2], min_replicas=2, now=0.0) is None  # one failure is no pattern
    assert s.failed(2, [0, 1, 2], min_replicas=2, now=0.1) is None  # the same epoch reported twice
    assert s.failed(3, [0, 1, 2], min_replicas=2, now=1.0) == 1
    assert s.held(5.0) == {1}
    assert s.held(11.0) == set()  # the hold ends: admitted again (as a newcomer)


def test_a_wrong_guess_is_given_back_even_when_the_epoch_left_is_at_the_minimum() -> None:
    s = SetAside(after_failures=2, hold_s=10.0)
    s.formed(1, [0, 1])
    s.formed(2, [0, 1, 2])
    s.failed(2, [0, 1, 2], min_replicas=2, now=0.0)
    assert s.failed(3, [0, 1, 2], min_replicas=2, now=1.0) == 2  # the last to join: a wrong guess
    # [0, 1] fails too: setting 1 aside alone would leave 0 below the minimum; with 2 back it does not
    assert s.failed(4, [0, 1], min_replicas=2, now=2.0) == 1
    assert s.held(2.0) == {1}


def test_a_wrong_guess_is_corrected_by_the_next_failure_and_a_commit_ends_the_streak() -> None:
    s = SetAside(after_failures=2, hold_s=10.0)
    s.formed(1, [0, 1, 2])
    s.failed(1, [0, 1, 2], 1, 0.0)
    assert s.failed(2, [0, 1, 2], 1, 0.0) == 2  # no one joined later: highest id first
    assert s.failed(3, [0, 1], 1, 1.0) == 1  # still failing without 2: 1 next, not 2 again
    assert s.held(1.0) == {1}  # and 2, a wrong guess, is given back at once
    s.progressed()
    assert s.failed(4, [0, 1, 2], 1, 2.0) is None  # a new streak


def test_the_hold_doubles_on_a_repeat_and_nobody_is_set_aside_below_the_minimum() -> None:
    s = SetAside(after_failures=1, hold_s=10.0)
    s.formed(1, [0, 1])
    assert s.failed(1, [0, 1], min_replicas=2, now=0.0) is None  # one member left could not train
    s.formed(2, [0, 1, 2])
    assert s.failed(2, [0, 1, 2], min_replicas=2, now=0.0) == 2
    s.progressed()
    assert s.failed(3, [0, 1, 2], min_replicas=2, now=20.0) == 2
    assert s.until[2] == 40.0


def test_the_failed_epochs_evidence_picks_whom_to_set_aside() -> None:
    # A lossy link at replica 1: the abandoned collectives' open transfers point at 1 (and its
    # peers once each), where the membership guess would have held healthy replica 2.
    s = SetAside(after_failures=2, hold_s=10.0)
    s.formed(1, [0, 1, 2])
    asked: list[list[int]] = []

    def blame(epochs: list[int]) -> dict[int, int]:
        asked.append(epochs)
        return {0: 1, 1: 2, 2: 1}

    assert s.failed(1, [0, 1, 2], 1, 0.0, blame) is None
    assert s.failed(2, [0, 1, 2], 1, 0.1, blame) == 1
    assert asked == [[1, 2]]  # asked about the streak's epochs
    # No evidence: the membership guess, as before.
    s.progressed()
    s.failed(3, [0, 2], 1, 1.0, lambda e: {})
    assert s.failed(4, [0, 2], 1, 1.1, lambda e: {}) == 2
