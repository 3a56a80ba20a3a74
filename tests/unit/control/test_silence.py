"""A replica silent long enough to have been evicted must not commit the step it resumes in."""

from __future__ import annotations

from unbroken.control.quorum.silence import SilenceWatch


def test_a_gap_between_heartbeats_over_the_limit_marks_the_steps_that_began_before_it() -> None:
    w = SilenceWatch(limit_s=1.0)
    w.beat(10.0)
    w.beat(10.1)
    assert not w.silent_since(10.0, 10.15)
    w.beat(13.0)  # stopped from 10.1 to 13.0, and the connection thread ran first on resuming
    assert w.silent_since(10.05, 13.01)  # the step that began before the stop may not commit
    assert not w.silent_since(13.5, 13.6)  # a step begun after it may


def test_a_stale_last_heartbeat_counts_before_the_connection_thread_runs_again() -> None:
    w = SilenceWatch(limit_s=1.0)
    w.beat(10.0)
    assert w.silent_since(9.9, 11.5)  # the training thread resumed first: the beat is 1.5 s old
    assert not w.silent_since(9.9, 10.5)


def test_no_connection_or_no_limit_is_not_silence() -> None:
    w = SilenceWatch(limit_s=1.0)
    w.beat(10.0)
    w.disconnected()  # a coordinator that is gone (a standby takes over): not this process's silence
    assert not w.silent_since(9.0, 20.0)
    w.beat(20.0)
    assert not w.silent_since(9.0, 20.1)  # the gap spans two connections
    untold = SilenceWatch()
    untold.beat(1.0)
    untold.beat(100.0)
    assert not untold.silent_since(0.0, 100.0)
