"""Hot spares: an epoch takes at most ``max_members`` replicas; the rest wait, parked, for a place."""

from __future__ import annotations

import pytest

from unbroken.control.quorum.rules import QuorumRequest, QuorumRules, QuorumState, choose_members


def with_spares(members: int, spares: int, step: int = 5) -> QuorumState:
    """``members`` replicas and ``spares`` hot spares (the highest ids) started together; the
    members formed epoch 1 and trained up to ``step`` on the fast path."""
    n = members + spares
    q = QuorumState(QuorumRules(total_replicas=n, min_replicas=1, max_members=members))
    for r in range(n):
        q.connect(r)
    formed = []
    for r in range(n):
        _, f = q.request(QuorumRequest(r, 0), 0.0)
        formed += f
    assert [d.members for d in formed] == [tuple(range(members))]
    assert set(q.parked) == set(range(members, n))
    for r in range(members):
        answer, new = q.request(QuorumRequest(r, step), 0.1)
        assert answer is not None and answer.epoch == 1 and new == []
    return q


def test_the_first_epoch_takes_the_configured_replicas_and_parks_the_spares() -> None:
    q = with_spares(2, 1)
    assert q.current is not None and q.current.members == (0, 1) and q.waiting == {}


def test_a_spare_asking_again_neither_forms_an_epoch_nor_holds_up_a_step() -> None:
    q = with_spares(2, 1)
    answer, formed = q.request(QuorumRequest(2, 0), 0.2)
    assert answer is None and formed == [] and q.forming_since is None
    answer, formed = q.request(QuorumRequest(0, 6), 0.3)  # the members' fast path goes on
    assert answer is not None and answer.epoch == 1 and answer.step == 6 and formed == []
    assert q.grant(0, 6, 4) > 6  # a parked spare does not stop grants, as a newcomer would


def test_a_lost_member_s_place_goes_to_a_spare_in_the_pushed_epoch() -> None:
    q = with_spares(3, 2)
    assert q.disconnect(1, 1.0) == []
    d = q.push({0: 5, 2: 5})
    assert d is not None and d.epoch == 2 and d.step == 5
    assert d.members == (0, 2, 3) and d.behind == (3,)  # the furthest along, then the lowest id
    assert d.donor_of(3) in (0, 2)
    assert set(q.parked) == {4}
    # The lost replica, restarted, waits as a spare in its turn.
    q.connect(1)
    answer, formed = q.request(QuorumRequest(1, 0), 1.5)
    assert answer is None and formed == [] and set(q.parked) == {1, 4}


def test_a_spare_never_displaces_a_member_when_an_epoch_forms_again() -> None:
    q = with_spares(2, 1)
    q.request(QuorumRequest(2, 9), 0.2)  # a spare claiming to be further along
    _, formed = q.request(QuorumRequest(0, 5, failed_epoch=1), 0.3)
    _, more = q.request(QuorumRequest(1, 5, failed_epoch=1), 0.3)
    assert [d.members for d in formed + more] == [(0, 1)]
    assert set(q.parked) == {2}


def test_a_spare_that_leaves_is_forgotten() -> None:
    q = with_spares(2, 1)
    q.disconnect(2, 0.5)
    assert q.parked == {} and q.current is not None and q.current.members == (0, 1) and not q.broken
    q.disconnect(1, 0.6)
    d = q.push({0: 5})
    assert d is not None and d.members == (0,)


def test_spares_count_for_the_majority_as_replicas_that_ask() -> None:
    q = with_spares(2, 2)  # 4 alive: a member alone is no majority, with two spares it is
    q.disconnect(1, 1.0)
    d = q.push({0: 5})
    assert d is not None and d.members == (0, 2) and d.behind == (2,)


def test_the_members_chosen_are_the_last_epoch_s_then_the_furthest_along_then_the_lowest_ids() -> None:
    assert choose_members({0: 5, 1: 5, 2: 9, 3: 0}, before=(0, 1), cap=3) == {0, 1, 2}
    assert choose_members({0: 0, 1: 0, 2: 0, 3: 0}, before=(), cap=2) == {0, 1}
    assert choose_members({3: 0, 2: 4, 5: 4}, before=(3,), cap=2) == {2, 3}


def test_max_members_must_fit_between_min_replicas_and_total_replicas() -> None:
    with pytest.raises(ValueError, match="max_members must be between min_replicas"):
        QuorumRules(total_replicas=3, min_replicas=2, max_members=1)
    with pytest.raises(ValueError, match="max_members must be between"):
        QuorumRules(total_replicas=3, max_members=4)
