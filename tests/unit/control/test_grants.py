"""Step grants: how far a fast answer stands, and that replicas' requests spread over the steps."""

from __future__ import annotations

from collections import Counter

from unbroken.control.quorum.grants import MAX_GRANT_STEPS, Grant, StepClock, grant_steps, grant_through


def test_no_grant_while_the_coordinator_keeps_up_or_the_step_time_is_unknown() -> None:
    assert grant_steps(2000, 1.0, 2000.0, 10.0) == 1
    assert grant_steps(12500, None, 2000.0, 10.0) == 1
    assert grant_steps(0, 1.0, 2000.0, 10.0) == 1


def test_grants_grow_with_the_request_rate_and_are_bounded_in_time_and_steps() -> None:
    assert grant_steps(12500, 1.0, 2000.0, 10.0) == 7
    assert grant_steps(12500, 0.1, 2000.0, 10.0) == 63
    assert grant_steps(12500, 0.01, 2000.0, 10.0) == MAX_GRANT_STEPS
    assert grant_steps(12500, 4.0, 100.0, 10.0) == 2  # 10 s of 4 s steps: 2
    assert grant_steps(12500, 20.0, 1.0, 10.0) == 1  # a step longer than the bound: none


def test_a_step_clock_read_a_little_slow_does_not_cut_a_grant_by_a_step() -> None:
    # 2 s steps under the 10 s bound: 5 steps, also when a busy minute reads the clock at 2.02 s
    # (before: 4 steps, and a quarter more requests reached the coordinator) ...
    assert grant_steps(12500, 2.0, 1000.0, 10.0) == grant_steps(12500, 2.02, 1000.0, 10.0) == 5
    # ... but a job that really runs slower gets the shorter grant its bound allows.
    assert grant_steps(12500, 2.2, 1000.0, 10.0) == 4


def test_each_replica_asks_once_every_k_steps_and_each_step_gets_its_share() -> None:
    k, replicas = 7, range(700)
    asked: Counter[int] = Counter()
    for r in replicas:
        step = 3
        while step < 200:
            asked[step] += 1
            through = grant_through(r, step, k)
            assert step <= through < step + k
            step = through + 1
    steady = [asked[s] for s in range(20, 190)]
    assert min(steady) == max(steady) == 100  # 700 replicas, one in seven each step
    assert grant_through(5, 9, 1) == 9


def test_the_step_clock_measures_the_pace_of_new_steps() -> None:
    clock = StepClock()
    assert clock.step_s() is None
    for i in range(3):
        clock.progressed(10.0 + 0.5 * i, 100 + i)
    assert clock.step_s() is None  # too few steps to tell
    for i in range(3, 12):
        clock.progressed(10.0 + 0.5 * i, 100 + i)
        clock.progressed(10.0 + 0.5 * i, 100 + i)  # the same step asked again: no sample
    assert clock.step_s() == 0.5
    clock.progressed(20.0, 50)  # the job went back (a rollback): the clock starts again
    assert clock.step_s() is None


def test_a_grant_answers_each_later_step_within_it_once_and_never_a_failure() -> None:
    assert Grant.from_answer(3, 5, None) is None and Grant.from_answer(3, 5, 5) is None
    g = Grant.from_answer(3, 5, 7)
    assert g is not None
    assert not g.answers(5, None) and not g.answers(6, 3)
    assert g.answers(6, None) and not g.answers(6, None) and g.answers(7, None) and not g.answers(8, None)
