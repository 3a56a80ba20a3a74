"""Lifecycle transitions and the restart/isolation policy, without processes."""

from __future__ import annotations

import pytest

from unbroken.launch.lifecycle import IllegalTransition, Lifecycle, State
from unbroken.launch.policy import EXIT_CRASH_LOOP, EXIT_RESTART_LIMIT, Placement, RestartBook, RestartPolicy, Slot


def test_lifecycle_follows_a_failure_through_recovery() -> None:
    lc = Lifecycle(2)
    lc.move(0, State.WARMING_UP, "connected", 1.0)
    assert [t.new for t in lc.on_quorum([0, 1], [], 2.0)] == [State.TRAINING, State.TRAINING]
    lc.move(1, State.FAILED, "exit -9", 3.0)
    lc.move(1, State.RECOVERING, "restart 1", 3.1)
    assert [t.new for t in lc.on_quorum([0, 1], [1], 5.0)] == [State.CATCHING_UP]
    assert [t.new for t in lc.on_quorum([0, 1], [], 6.0)] == [State.TRAINING]
    assert [(t.old, t.new) for t in lc.history if t.replica == 1] == [
        (State.LAUNCHING, State.TRAINING),
        (State.TRAINING, State.FAILED),
        (State.FAILED, State.RECOVERING),
        (State.RECOVERING, State.CATCHING_UP),
        (State.CATCHING_UP, State.TRAINING),
    ]
    assert all(t.reason for t in lc.history)


def test_lifecycle_rejects_transitions_it_does_not_have() -> None:
    lc = Lifecycle(1)
    with pytest.raises(IllegalTransition, match="launching -> recovering"):
        lc.move(0, State.RECOVERING, "?", 0.0)
    lc.move(0, State.FINISHED, "done", 1.0)
    assert lc.try_move(0, State.FAILED, "late exit", 2.0) is None
    assert lc.state[0] == State.FINISHED and lc.live() == []


def test_backoff_grows_exponentially_and_resets_on_progress() -> None:
    book = RestartBook(RestartPolicy(backoff_initial_s=0.5, backoff_factor=2, backoff_max_s=3))
    delays = []
    for _ in range(5):
        d = book.decide(0)
        assert d.action == "restart"
        delays.append(d.delay_s)
        book.restarted(0)
        book.progress()  # the others keep training: no crash loop
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    book.progress(0)
    assert book.decide(0).delay_s == 0.5


def test_restart_limits_per_replica_and_per_job() -> None:
    book = RestartBook(RestartPolicy(max_restarts_per_replica=2, max_restarts_per_job=3, crash_loop_restarts=99))
    book.restarted(0)
    book.restarted(0)
    assert book.decide(0).action == "stop"
    assert book.decide(1).action == "restart"
    book.restarted(1)
    d = book.decide(2)
    assert (d.action, d.exit_code) == ("end_job", EXIT_RESTART_LIMIT)


def test_crash_loop_ends_the_job_with_93() -> None:
    book = RestartBook(RestartPolicy(crash_loop_restarts=3))
    for r in (0, 1, 2):
        assert book.decide(r).action == "restart"
        book.restarted(r)
    d = book.decide(0)
    assert (d.action, d.exit_code) == ("end_job", EXIT_CRASH_LOOP)
    assert "crash loop" in d.reason and "no step committed" in d.reason
    book.progress()
    assert book.decide(0).action == "restart"


def test_bad_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="backoff_factor=0.5"):
        RestartPolicy(backoff_factor=0.5)


def _slots() -> list[Slot]:
    return [Slot("a", 0), Slot("b", 0), Slot("c", 0), Slot("d", 0, spare=True)]


def test_a_blamed_node_is_isolated_and_its_replica_moves_to_the_spare() -> None:
    pl = Placement(_slots(), 3, RestartPolicy(blame_threshold=2, blame_window_s=10, readmit_after_s=5))
    assert not pl.blame("b", 0.0)
    assert pl.place(1) == Slot("b", 0)  # one fault: restart in place
    assert not pl.blame("b", 20.0)  # the first fault fell out of the window
    assert pl.blame("b", 25.0)
    assert pl.place(1) == Slot("d", 0, spare=True)
    assert pl.due_for_check(26.0) == [] and pl.due_for_check(30.0) == ["b"]
    assert not pl.readmit("b", passed=False, now=30.0)
    assert "b" in pl.isolated
    assert pl.readmit("b", passed=True, now=40.0)
    assert pl.free_slots() == [Slot("b", 0)]


def test_no_free_slot_means_no_placement() -> None:
    pl = Placement(_slots()[:3], 3, RestartPolicy(blame_threshold=1))
    assert pl.blame("a", 0.0)
    assert pl.place(0) is None


def test_no_isolation_that_would_leave_too_few_replicas_to_train() -> None:
    # Three replicas, all needed, no spare: isolating a node would park its replica for good.
    pl = Placement(_slots()[:3], 3, RestartPolicy(blame_threshold=1), min_replicas=3)
    assert not pl.blame("a", 0.0)
    assert pl.place(0) == Slot("a", 0)
    # With a spare, the same blame isolates and the replica moves.
    pl = Placement(_slots(), 3, RestartPolicy(blame_threshold=1), min_replicas=3)
    assert pl.blame("a", 0.0)
    assert pl.place(0) == Slot("d", 0, spare=True)


def test_a_lost_node_gives_back_its_replicas() -> None:
    pl = Placement(_slots(), 3, RestartPolicy())
    assert pl.remove_node("c") == [2]
    assert pl.place(2) == Slot("d", 0, spare=True)
    with pytest.raises(ValueError, match="need 3 slots"):
        Placement([Slot("a", 0), Slot("b", 0, spare=True)], 3, RestartPolicy())
