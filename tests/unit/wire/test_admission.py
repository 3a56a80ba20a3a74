"""The strangers' budget of a listener: newest first, per source, a deadline; refusals logged once per interval."""

from __future__ import annotations

import logging

import pytest

from unbroken.wire.admission import Admission, AdmissionPolicy, RefusalLog


def test_a_full_budget_sheds_the_oldest_and_admits_the_newcomer() -> None:
    a: Admission[str] = Admission(AdmissionPolicy(max_pending=3, max_pending_per_source=3, deadline_s=5.0))
    assert [a.admit(k, "10.0.0.1", t) for t, k in enumerate("abc")] == [[], [], []]
    assert a.admit("d", "10.0.0.1", 3.0) == ["a"]
    assert a.admit("e", "10.0.0.1", 4.0) == ["b"]
    assert len(a) == 3 and "e" in a and "a" not in a
    assert a.evicted == 2


def test_a_flooding_source_sheds_its_own_connections_not_anothers() -> None:
    a: Admission[str] = Admission(AdmissionPolicy(max_pending=4, max_pending_per_source=2, deadline_s=5.0))
    a.admit("legit", "10.0.0.9", 0.0)
    shed = [v for i in range(50) for v in a.admit(f"x{i}", "10.0.0.1", 1.0 + i)]
    assert "legit" in a and "legit" not in shed
    assert len(a) == 3  # the stranger holds its 2, no more


def test_when_the_total_is_full_the_busiest_source_pays() -> None:
    a: Admission[str] = Admission(AdmissionPolicy(max_pending=4, max_pending_per_source=3, deadline_s=5.0))
    a.admit("old-legit", "10.0.0.9", 0.0)
    for i in range(3):
        a.admit(f"x{i}", "10.0.0.1", 1.0 + i)
    assert a.admit("new", "10.0.0.2", 5.0) == ["x0"]  # not the older connection of a quiet source


def test_released_connections_free_their_place_and_expire_no_more() -> None:
    a: Admission[str] = Admission(AdmissionPolicy(max_pending=2, max_pending_per_source=2, deadline_s=1.0))
    a.admit("a", "s", 0.0)
    a.admit("b", "s", 0.5)
    a.release("a")  # authenticated: it no longer counts
    a.release("a")  # twice is harmless
    assert a.admit("c", "s", 0.6) == []
    assert a.next_deadline() == 1.5
    assert a.expired(1.55) == ["b"]
    assert a.expired(1.59) == [] and len(a) == 1
    assert a.expired(1.6 + 1.0) == ["c"] and a.next_deadline() is None


def test_a_burst_does_not_push_out_a_connection_whose_ticket_is_on_its_way() -> None:
    """Connections younger than min_age are not shed: a burst goes over budget instead, up to
    the hard cap, where the oldest goes whatever its age."""
    p = AdmissionPolicy(max_pending=4, max_pending_per_source=4, deadline_s=5.0, min_age_s=0.5, overflow=2)
    a: Admission[str] = Admission(p)
    a.admit("legit", "127.0.0.1", 0.0)
    shed = [a.admit(f"x{i}", "127.0.0.1", 0.01 + i * 0.001) for i in range(6)]
    assert shed == [[]] * 6 and "legit" in a and len(a) == 7  # over budget, under the cap
    assert a.admit("x6", "127.0.0.1", 0.1) == [] and len(a) == 8
    assert a.admit("x7", "127.0.0.1", 0.1) == ["legit"]  # the cap: twice the budget
    assert len(a) == 8
    assert a.admit("late", "127.0.0.1", 1.0) == ["x0"]  # old enough now


def test_bad_policies_are_refused_with_what_to_fix() -> None:
    with pytest.raises(ValueError, match="max_pending_per_source"):
        AdmissionPolicy(max_pending=2, max_pending_per_source=3)
    with pytest.raises(ValueError, match="deadline_s"):
        AdmissionPolicy(deadline_s=float("nan"))
    with pytest.raises(ValueError, match="min_age_s"):
        AdmissionPolicy(deadline_s=1.0, min_age_s=2.0)
    a: Admission[str] = Admission()
    a.admit("a", "s", 0.0)
    with pytest.raises(ValueError, match="pending already"):
        a.admit("a", "s", 0.0)


def test_a_flood_of_refusals_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    log = RefusalLog(logging.getLogger("test.refusals"), "refused things", interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        logged = [log.note("no ticket", t * 0.1) for t in range(1000)]  # 100 s of refusals
        assert log.note("no ticket", 200.0)
    assert sum(logged) == 2 and log.total == 1001
    assert len(caplog.records) == 3
    assert "599 more since the last report" in caplog.records[1].getMessage()
