"""Pushed epochs: on an eviction the next epoch forms at once, under the rules of a formed one."""

from __future__ import annotations

from unbroken.control.quorum.rules import (
    QuorumDecision,
    QuorumRequest,
    QuorumRules,
    QuorumState,
    decision,
    push_answers,
)


def training(n: int, step: int = 5, min_replicas: int = 1) -> QuorumState:
    """``n`` replicas formed epoch 1 at step 0 and trained up to ``step`` on the fast path."""
    q = QuorumState(QuorumRules(total_replicas=n, min_replicas=min_replicas))
    for r in range(n):
        q.connect(r)
    for r in range(n):
        q.request(QuorumRequest(r, 0), 0.0)
    assert q.current is not None and q.current.epoch == 1
    for r in range(n):
        answer, _ = q.request(QuorumRequest(r, step), 0.0)
        assert answer is not None and answer.epoch == 1
    return q


def test_a_death_pushes_the_next_epoch_of_the_members_still_heard_at_once() -> None:
    q = training(4)
    assert q.disconnect(3, 1.0) == []  # nobody asked again: forming alone would wait for re-asks
    d = q.push({0: 5, 1: 5, 2: 5})
    assert d is not None
    assert (d.epoch, d.step, d.members, d.behind) == (2, 5, (0, 1, 2), ())
    assert q.current == d and not q.broken and q.forming_since is None
    # The members then go on on the fast path of the pushed epoch.
    answer, formed = q.request(QuorumRequest(0, 6), 1.1)
    assert answer is not None and answer.epoch == 2 and answer.step == 6 and formed == []


def test_a_push_answers_those_who_asked_again_and_admits_a_waiting_newcomer_behind() -> None:
    q = training(4)
    q.disconnect(3, 1.0)
    q.request(QuorumRequest(0, 5, failed_epoch=1), 1.0)  # noticed the failure before the eviction
    q.connect(3)  # the dead replica's restart, back from an older checkpoint, waiting
    q.request(QuorumRequest(3, 2), 1.0)
    d = q.push({1: 5, 2: 5})
    assert d is not None
    assert d.members == (0, 1, 2, 3) and d.step == 5 and d.behind == (3,)
    assert d.donor_of(3) in (0, 1, 2)
    assert q.waiting == {}


def test_members_in_flight_train_in_lock_step_and_none_is_ahead_of_the_epoch() -> None:
    q = training(4)
    q.disconnect(3, 1.0)
    # 2 was last heard at step 4 (it had not asked for step 5 yet, while 0 had: so every member
    # finished step 4's exchange); 1 claims a step its epoch never trained: step 5 at most.
    d = q.push({0: 5, 1: 10**9, 2: 4})
    assert d is not None
    assert d.step == 5 and d.behind == () and d.members == (0, 1, 2)


def test_a_member_catching_up_stays_behind_in_the_push() -> None:
    q = training(3)
    q.disconnect(2, 1.0)
    assert q.push({0: 5, 1: 5}) is not None
    q.connect(2)
    q.request(QuorumRequest(2, 1), 1.1)  # back from an old checkpoint: waits to be admitted
    q.request(QuorumRequest(0, 6), 1.2)
    _, formed = q.request(QuorumRequest(1, 6), 1.3)
    assert [(d.step, d.behind) for d in formed] == [(6, (2,))]
    q.disconnect(1, 2.0)  # while 2 catches up
    pushed = q.push({0: 6, 2: 1})
    assert pushed is not None and pushed.step == 6 and pushed.behind == (2,)


def test_under_a_grant_members_are_pushed_at_the_newest_step_heard_within_it() -> None:
    q = training(4)
    assert q.grant(0, 5, 4) == 7  # replica 0's phase: it asks again at step 8
    q.disconnect(3, 1.0)
    d = q.push({0: 6, 1: 5, 2: 6})  # heartbeats lag: 1 was last heard at 5
    assert d is not None and d.step == 6 and d.behind == () and d.members == (0, 1, 2)


def test_a_step_claimed_past_the_grant_is_bounded_by_it() -> None:
    q = training(4)
    q.grant(0, 5, 4)
    q.disconnect(3, 1.0)
    d = q.push({0: 6, 1: 10**9, 2: 6})
    assert d is not None and d.step == 7 and d.behind == ()


def test_no_grant_while_a_newcomer_waits_and_it_is_admitted_after_the_granted_steps() -> None:
    q = training(3)
    q.disconnect(2, 1.0)
    q.push({0: 5, 1: 5})
    assert q.grant(0, 5, 4) == 7
    q.connect(2)
    q.request(QuorumRequest(2, 0), 1.1)
    assert q.grant(1, 5, 4) == 5  # one waits: no further grant
    for step in (6, 7):  # granted steps: their membership stands
        for r in (0, 1):
            answer, formed = q.request(QuorumRequest(r, step), 1.2)
            assert answer is not None and answer.members == (0, 1) and formed == []
    answer, _ = q.request(QuorumRequest(0, 8), 1.3)
    assert answer is None
    _, formed = q.request(QuorumRequest(1, 8), 1.3)
    assert [(d.step, d.members, d.behind) for d in formed] == [(8, (0, 1, 2), (2,))]
    assert q.granted_through == -1


def test_a_silent_or_dead_member_is_left_out_of_the_push() -> None:
    q = training(4)
    q.set_silent({2}, 1.0)
    q.disconnect(3, 1.0)
    d = q.push({0: 5, 1: 5, 2: 5, 3: 5})
    assert d is not None and d.members == (0, 1)


def test_no_push_without_a_majority_or_min_replicas_and_the_epoch_stays_broken() -> None:
    q = training(4)
    q.set_silent({1, 2}, 1.0)
    q.disconnect(3, 1.0)
    assert q.push({0: 5, 1: 5, 2: 5}) is None  # 1 of the 3 alive
    assert q.broken and q.epoch == 1
    q2 = training(4, min_replicas=4)
    q2.disconnect(3, 1.0)
    assert q2.push({0: 5, 1: 5, 2: 5}) is None
    assert q2.broken and q2.epoch == 1


def test_no_push_past_the_reserved_epochs_and_none_while_the_epoch_stands() -> None:
    q = training(3)
    assert q.push({0: 5, 1: 5}) is None  # nothing broke
    q.epoch_limit = 1
    q.disconnect(2, 1.0)
    assert q.push({0: 5, 1: 5}) is None
    q.epoch_limit = 2
    d = q.push({0: 5, 1: 5})
    assert d is not None and d.epoch == 2


def test_epochs_keep_growing_across_pushes_and_formed_epochs() -> None:
    q = training(5)
    q.disconnect(4, 1.0)
    first = q.push({0: 5, 1: 5, 2: 5, 3: 5})
    q.disconnect(3, 1.1)
    second = q.push({0: 5, 1: 5, 2: 5})
    assert first is not None and second is not None
    assert (first.epoch, second.epoch) == (2, 3) and second.members == (0, 1, 2)


def test_a_push_answers_the_request_it_stands_for_and_no_other() -> None:
    d = QuorumDecision(epoch=7, step=5, members=(0, 1, 2), behind=(2,), donors=((2, 0),))
    assert push_answers(d, 0, 5, failed_epoch=6)  # the re-ask after the broken epoch
    assert push_answers(d, 0, 5, failed_epoch=None)
    assert push_answers(d, 2, 4, failed_epoch=6)  # behind: it catches up to step 5
    assert not push_answers(d, 0, 6, None)  # moved past the pushed step: asks
    assert not push_answers(d, 0, 4, 6)  # older than the step it is up to date at
    assert not push_answers(d, 0, 5, failed_epoch=7)  # the pushed epoch itself failed
    assert not push_answers(d, 3, 5, None)  # not a member


def test_a_resumed_epoch_admits_no_newcomer_until_the_previous_coordinator_s_grants_ran_out() -> None:
    # A standby continues the epoch; the relays keep the grants the coordinator before it gave,
    # for steps it cannot know: a newcomer admitted at one of them would split the members.
    q = QuorumState(QuorumRules(total_replicas=3, min_replicas=1, join_window_s=0.1, startup_window_s=1.0))
    q.resume(decision(4, 10, (0, 1), ()))
    q.connect(2)
    q.request(QuorumRequest(2, 0), 1.0)  # a newcomer waits
    for step in (11, 30):  # any step a relay may still be answering alone: the epoch stands
        for r in (0, 1):
            answer, formed = q.request(QuorumRequest(r, step), 1.1)
            assert answer is not None and answer.epoch == 4 and formed == []
    assert q.grant(0, 30, 4) == 30  # and this one grants nothing while the newcomer waits
    q.lift_grants()  # max_grant_s after the takeover: they ran out
    assert q.request(QuorumRequest(0, 31), 2.0)[0] is None
    _, formed = q.request(QuorumRequest(1, 31), 2.0)
    assert [(d.step, d.members, d.behind) for d in formed] == [(31, (0, 1, 2), (2,))]
