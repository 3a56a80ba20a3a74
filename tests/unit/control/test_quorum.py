"""Quorum rules: fast path, forming, catch-up assignment, split-brain safety."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.control.quorum.rules import (
    MAX_MEMBERS,
    QuorumDecision,
    QuorumRequest,
    QuorumRules,
    QuorumState,
    member_runs,
    members_of_runs,
)


def started(n: int = 3, min_replicas: int = 1, step: int = 0) -> QuorumState:
    q = QuorumState(QuorumRules(total_replicas=n, min_replicas=min_replicas, join_window_s=1.0))
    for r in range(n):
        q.connect(r)
    decisions: list[QuorumDecision] = []
    for r in range(n):
        answer, formed = q.request(QuorumRequest(r, step), now=0.0)
        assert answer is None
        decisions += formed
    assert len(decisions) == 1 and decisions[0].members == tuple(range(n))
    return q


def two_left_of_four() -> QuorumState:
    """Replicas 2 and 3 of four died; 0 and 1 went on alone at step 10."""
    q = started(n=4)
    for r in (2, 3):
        q.disconnect(r, 1.0)
    q.request(QuorumRequest(0, 10, failed_epoch=1), 1.0)
    _, formed = q.request(QuorumRequest(1, 10, failed_epoch=1), 1.0)
    assert formed[0].members == (0, 1)
    return q


def test_first_quorum_waits_for_all_configured_replicas() -> None:
    q = QuorumState(QuorumRules(total_replicas=3))
    for r in range(3):
        q.connect(r)
    assert q.request(QuorumRequest(0, 0), 0.0) == (None, [])
    assert q.request(QuorumRequest(1, 0), 0.1) == (None, [])
    _, formed = q.request(QuorumRequest(2, 0), 0.2)
    assert formed[0].epoch == 1 and formed[0].members == (0, 1, 2) and formed[0].behind == ()


def test_first_quorum_forms_without_a_missing_replica_after_the_startup_window() -> None:
    q = QuorumState(QuorumRules(total_replicas=3, startup_window_s=5.0))
    q.connect(0)
    q.connect(1)
    q.request(QuorumRequest(0, 0), 0.0)
    q.request(QuorumRequest(1, 0), 0.0)
    assert q.evaluate(4.9) == []
    assert q.evaluate(5.0)[0].members == (0, 1)


def test_fast_path_answers_at_once_with_the_same_epoch() -> None:
    q = started()
    for step in (1, 2, 3):
        for r in range(3):
            answer, formed = q.request(QuorumRequest(r, step), now=step)
            assert answer is not None and answer.epoch == 1 and answer.step == step
            assert formed == []


def test_the_next_step_of_an_epoch_keeps_the_stores_its_groups_were_told() -> None:
    q = started()
    first, _ = q.request(QuorumRequest(0, 1), now=1.0)
    assert first is not None
    first.stores[0] = "10.0.0.7:4100"  # rank 0's group was told this store in the epoch's answers
    following, _ = q.request(QuorumRequest(0, 2), now=2.0)
    assert following is not None and following is not first and following.step == 2
    assert following.stores == {0: "10.0.0.7:4100"}
    assert following.leader == first.leader


def test_crash_of_a_member_forms_a_new_epoch_without_it() -> None:
    q = started()
    q.request(QuorumRequest(0, 1), 1.0)
    assert q.disconnect(2, 1.1) == []
    assert q.in_flight_members() == (0, 1)
    q.request(QuorumRequest(0, 1, failed_epoch=1), 1.2)
    _, formed = q.request(QuorumRequest(1, 1, failed_epoch=1), 1.2)
    assert formed[0].epoch == 2 and formed[0].members == (0, 1) and formed[0].step == 1


def test_hung_member_is_left_out_after_the_join_window() -> None:
    q = started()
    q.request(QuorumRequest(0, 1, failed_epoch=1), 1.0)
    assert q.request(QuorumRequest(1, 1, failed_epoch=1), 1.0) == (None, [])
    assert q.evaluate(1.9) == []
    formed = q.evaluate(2.0)
    assert formed[0].members == (0, 1)


def test_silent_member_is_not_waited_for_but_still_counts_for_the_majority() -> None:
    q = started()
    q.request(QuorumRequest(0, 1, failed_epoch=1), 1.0)
    assert q.request(QuorumRequest(1, 1, failed_epoch=1), 1.0) == (None, [])
    formed = q.set_silent({2}, 1.1)  # replica 2 stopped heartbeating: a hang, not yet evicted
    assert formed[0].members == (0, 1) and formed[0].epoch == 2
    # Silence does not shrink the electorate: one asker of three alive is still a minority.
    q2 = started()
    q2.request(QuorumRequest(0, 1, failed_epoch=1), 1.0)
    assert q2.set_silent({1, 2}, 1.1) == []
    assert q2.evaluate(5.0) == []


def test_newcomer_is_admitted_at_the_next_step_behind_with_a_donor() -> None:
    q = started()
    # Member 0 already got step 5's answer; the newcomer must not split step 5.
    q.request(QuorumRequest(0, 5), 5.0)
    q.connect(3)
    assert q.request(QuorumRequest(3, 0), 5.0) == (None, [])
    for r in (1, 2):
        answer, _ = q.request(QuorumRequest(r, 5), 5.0)
        assert answer is not None and answer.members == (0, 1, 2)
    formed = []
    for r in range(3):
        answer, f = q.request(QuorumRequest(r, 6), 6.0)
        assert answer is None
        formed += f
    d = formed[0]
    assert d.members == (0, 1, 2, 3) and d.step == 6 and d.behind == (3,)
    assert d.donor_of(3) in (0, 1, 2) and d.contributing == 3


def test_donors_are_spread_across_up_to_date_members() -> None:
    q = two_left_of_four()
    for r in (2, 3):
        q.connect(r)
        q.request(QuorumRequest(r, 0), 2.0)
    q.request(QuorumRequest(0, 11), 2.0)
    _, formed = q.request(QuorumRequest(1, 11), 2.0)
    d = formed[0]
    assert set(d.behind) == {2, 3}
    assert {d.donor_of(2), d.donor_of(3)} == {0, 1}


def test_upcoming_donors_forecast_the_donors_of_the_next_decision() -> None:
    q = two_left_of_four()
    assert q.upcoming_donors() == {}  # nobody is waiting to join
    q.connect(2)
    q.request(QuorumRequest(2, 0), 2.0)
    assert q.upcoming_donors() == {2: 0}
    q.connect(3)
    q.request(QuorumRequest(3, 0), 2.0)
    forecast = q.upcoming_donors()
    q.request(QuorumRequest(0, 11), 2.5)
    assert q.upcoming_donors() == forecast  # a member asking is no newcomer
    _, formed = q.request(QuorumRequest(1, 11), 2.5)
    assert dict(formed[0].donors) == forecast == {2: 0, 3: 1}
    assert q.upcoming_donors() == {}


def test_the_upcoming_epoch_is_forecast_with_its_newcomers_as_it_then_forms() -> None:
    q = two_left_of_four()
    assert q.upcoming_epoch() is None  # nobody is waiting to join
    q.connect(2)
    q.request(QuorumRequest(2, 0), 2.0)
    forecast = q.upcoming_epoch()
    assert forecast is not None
    q.request(QuorumRequest(0, 11), 2.5)
    _, formed = q.request(QuorumRequest(1, 11), 2.5)
    assert (formed[0].epoch, formed[0].members) == (forecast.epoch, forecast.members) == (forecast.epoch, (0, 1, 2))
    assert q.upcoming_epoch() is None


def test_no_epoch_is_forecast_where_a_member_is_silent_or_the_newcomer_would_be_parked() -> None:
    q = two_left_of_four()
    q.connect(2)
    q.request(QuorumRequest(2, 0), 2.0)
    q.silent.add(1)  # it may be evicted first: the next epoch is not known
    assert q.upcoming_epoch() is None
    capped = started(n=2)
    capped.rules = dataclasses.replace(capped.rules, max_members=2)
    capped.connect(2)
    capped.request(QuorumRequest(2, 0), 1.0)
    assert capped.upcoming_epoch() is None  # a full epoch parks the spare: nothing forms


def test_no_donor_is_forecast_while_the_epoch_is_broken() -> None:
    q = started()
    q.disconnect(2, 1.0)  # the members' exchange fails: the next decision is not yet known
    q.connect(2)
    q.request(QuorumRequest(2, 0), 1.5)
    assert q.upcoming_donors() == {}


def test_join_window_for_a_newcomer_counts_from_the_first_member_that_asks() -> None:
    q = started()
    q.connect(3)
    q.request(QuorumRequest(3, 0), 1.0)
    assert q.evaluate(30.0) == []  # members are mid-step: nobody is left out
    q.request(QuorumRequest(0, 1), 30.0)
    q.request(QuorumRequest(1, 1), 30.5)
    assert q.evaluate(30.9) == []
    assert q.evaluate(31.0)[0].members == (0, 1, 3)  # 2 is presumed hung


def test_no_quorum_below_min_replicas_then_resumes() -> None:
    q = started(n=3, min_replicas=2)
    q.disconnect(1, 1.0)
    q.disconnect(2, 1.0)
    assert q.request(QuorumRequest(0, 1, failed_epoch=1), 1.0) == (None, [])
    assert q.evaluate(100.0) == []
    q.connect(1)
    _, formed = q.request(QuorumRequest(1, 0), 101.0)
    assert formed[0].members == (0, 1) and formed[0].behind == (1,)


def test_minority_never_forms_even_if_min_replicas_allows() -> None:
    q = started(n=4, min_replicas=1)
    # Replica 0 is cut off from 1..3 (they are alive but do not answer it).
    q.request(QuorumRequest(0, 1, failed_epoch=1), 1.0)
    assert q.evaluate(50.0) == []


def test_bad_rules_are_rejected_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        QuorumRules(total_replicas=2, min_replicas=3)
    with pytest.raises(ValueError, match="total_replicas"):
        QuorumRules(total_replicas=0)


def test_restarted_coordinator_continues_with_higher_epochs() -> None:
    q = QuorumState(QuorumRules(total_replicas=1), first_epoch=41)
    q.connect(0)
    _, formed = q.request(QuorumRequest(0, 7), 0.0)
    assert formed[0].epoch == 42 and formed[0].step == 7


def test_decision_round_trips_through_json() -> None:
    d = QuorumDecision(3, 9, (0, 2, 5), (5,), ((5, 0),))
    assert QuorumDecision.from_json(d.to_json()) == d


events = st.lists(
    st.tuples(
        st.sampled_from(["ask", "fail", "disconnect", "connect", "tick"]),
        st.integers(0, 4),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_invariants_hold_under_any_sequence_of_events(evs: list[tuple[str, int]]) -> None:
    """Epochs only grow; one membership per (epoch, step); every quorum is a live majority."""
    rules = QuorumRules(total_replicas=5, min_replicas=2, join_window_s=1.0, startup_window_s=2.0)
    q = QuorumState(rules)
    steps = dict.fromkeys(range(5), 0)
    last_epoch = 0
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    now = 0.0
    for kind, r in evs:
        now += 0.3
        formed: list[QuorumDecision] = []
        answer = None
        if kind == "connect":
            q.connect(r)
        elif kind == "disconnect":
            formed = q.disconnect(r, now)
        elif kind == "tick":
            formed = q.evaluate(now)
        else:
            failed = q.current.epoch if (kind == "fail" and q.current) else None
            answer, formed = q.request(QuorumRequest(r, steps[r], failed), now)
        for d in formed + ([answer] if answer else []):
            assert d.epoch >= last_epoch
            last_epoch = d.epoch
            assert seen.setdefault((d.epoch, d.step), d.members) == d.members
        for d in formed:
            assert len(d.members) >= rules.min_replicas
            assert 2 * len(d.members) > len(q.alive)
            assert set(d.behind) < set(d.members)
            for m in d.members:
                steps[m] = d.step + 1
        if answer is not None:
            steps[r] = answer.step + 1


@given(st.sets(st.integers(min_value=0, max_value=300)))
def test_member_runs_round_trip(ids: set[int]) -> None:
    members = tuple(sorted(ids))
    runs = member_runs(members)
    assert members_of_runs(runs) == members
    assert all(b[0] > a[1] + 1 for a, b in zip(runs, runs[1:], strict=False))  # maximal runs: gaps between them
    d = QuorumDecision(3, 7, members, behind=members[:1], donors=())
    assert QuorumDecision.from_json(d.to_json()) == d


def test_a_decision_of_1000_groups_less_one_is_two_runs() -> None:
    members = tuple(m for m in range(1000) if m != 417)
    assert QuorumDecision(2, 9, members).to_json()["member_runs"] == [[0, 416], [418, 999]]


@pytest.mark.parametrize(
    "runs",
    [
        {"0": 1},
        [[0, 1], [1, 2]],  # overlapping
        [[3, 4], [0, 1]],  # not increasing
        [[2, 1]],
        [[-1, 2]],
        [[0, 1, 2]],
        [[0, True]],
        [[0.0, 1]],
        [[0, MAX_MEMBERS]],  # one more than the bound: a pair of numbers must not allocate a job
    ],
)
def test_malformed_member_runs_are_refused(runs: object) -> None:
    with pytest.raises(ValueError, match="member_runs"):
        members_of_runs(runs)


def test_each_replica_named_in_a_donor_pair_gets_its_own_pairs() -> None:
    d = QuorumDecision(5, 9, tuple(range(6)), behind=(3, 4, 5), donors=((3, 0), (4, 1), (5, 0)))
    by = d.donors_by_replica()
    assert by == {3: [[3, 0]], 0: [[3, 0], [5, 0]], 4: [[4, 1]], 1: [[4, 1]], 5: [[5, 0]]}
    assert 2 not in by  # an up-to-date member that serves nobody gets no pair
    assert d.to_json()["behind_runs"] == [[3, 5]]
    mine = QuorumDecision.from_json({**d.to_json(), "donors": by[4]})
    assert mine.donor_of(4) == 1 and mine.contributing == 3 and mine.behind_set == {3, 4, 5}


def test_a_decision_for_the_next_step_keeps_nothing_of_the_last_ones_answers() -> None:
    """The answer text and donor maps are made once per decision: the fast path's next step is a
    new decision, whose answers must not carry the last one's donors or text."""
    d = QuorumDecision(epoch=3, step=7, members=(0, 1, 2), behind=(2,), donors=((2, 0),))
    assert d.donor_map == {2: 0} and d.donor_of(2) == 0 and d.donors_by_replica() == {2: [[2, 0]], 0: [[2, 0]]}
    d.wire["127.0.0.1:1"] = b"the text of step 7"
    nxt = dataclasses.replace(d, step=8, behind=(), donors=())
    assert nxt.wire == {} and nxt.donor_map == {} and nxt.donors_by_replica() == {}
    assert d.wire == {"127.0.0.1:1": b"the text of step 7"}
