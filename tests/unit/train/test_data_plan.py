"""The sample plan of a step is a pure function of (step, configured replicas, contributors), and
under ``constant_global_batch`` every step trains exactly the fault-free run's samples."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken.control.quorum.rules import QuorumDecision
from unbroken.train.data import (
    CONSTANT_GLOBAL_BATCH,
    SKIP,
    SampleAccount,
    contributing_of,
    plan_step,
    rank_plan,
    slot_samples,
)


def step_ids(
    step: int, replicas: int, contributing: list[int], policy: str, per_replica: int, world_size: int
) -> list[int]:
    """Every sample id any rank of any replica trains at ``step``."""
    plan = plan_step(step, replicas, contributing, policy)
    return [
        i
        for c in plan.slots
        for k in range(world_size)
        for mb in rank_plan(plan, c, k, world_size, replicas, per_replica).micro_batches
        for i in mb
    ]


def test_fault_free_run_reads_the_samples_in_order() -> None:
    ids = [i for step in range(4) for i in step_ids(step, 3, [0, 1, 2], SKIP, 4, 2)]
    assert sorted(ids) == list(range(4 * 3 * 4))
    assert plan_step(7, 3, [0, 1, 2], CONSTANT_GLOBAL_BATCH) == plan_step(7, 3, [2, 0, 1], SKIP)


@given(replicas=st.integers(1, 6), step=st.integers(0, 1000), data=st.data(), world=st.sampled_from([1, 2, 4]))
def test_constant_global_batch_trains_every_sample_of_the_step_exactly_once(
    replicas: int, step: int, data: st.DataObject, world: int
) -> None:
    contributing = data.draw(st.lists(st.integers(0, replicas + 1), min_size=1, unique=True))
    ids = step_ids(step, replicas, contributing, CONSTANT_GLOBAL_BATCH, 4 * world, world)
    fault_free = step_ids(step, replicas, list(range(replicas)), CONSTANT_GLOBAL_BATCH, 4 * world, world)
    assert (
        sorted(ids) == sorted(fault_free) == list(range(step * replicas * 4 * world, (step + 1) * replicas * 4 * world))
    )


def test_missing_replicas_slots_are_taken_over_round_robin() -> None:
    plan = plan_step(5, 4, [0, 2], CONSTANT_GLOBAL_BATCH)
    assert plan.slots == {0: (0, 1), 2: (2, 3)}
    assert plan.skipped == ()
    # The average over 2 contributors of (2/4 * sum of their slots) is the mean over 4 slots.
    assert plan.loss_scale == pytest.approx(2 / 4)
    assert plan_step(5, 4, [3], CONSTANT_GLOBAL_BATCH).slots == {3: (0, 1, 2, 3)}


def test_skip_leaves_the_missing_slots_and_keeps_the_mean() -> None:
    plan = plan_step(5, 4, [0, 2], SKIP)
    assert plan.slots == {0: (0,), 2: (2,)}
    assert plan.skipped == (1, 3)
    assert plan.loss_scale == 1.0


def test_a_spare_takes_an_orphaned_slot_under_both_policies() -> None:
    for policy in (SKIP, CONSTANT_GLOBAL_BATCH):
        plan = plan_step(0, 3, [0, 2, 5], policy)
        assert plan.slots == {0: (0,), 2: (2,), 5: (1,)}
        assert plan.skipped == ()


def test_more_contributors_than_slots_keeps_the_average_right() -> None:
    plan = plan_step(0, 2, [0, 1, 7], SKIP)
    assert plan.slots == {0: (0,), 1: (1,), 7: ()}
    assert plan.loss_scale == pytest.approx(3 / 2)  # the idle contributor's zero gradient is divided back out


def test_ranks_split_each_slot_into_equal_contiguous_parts() -> None:
    plan = plan_step(1, 2, [1], CONSTANT_GLOBAL_BATCH)
    parts = [rank_plan(plan, 1, k, 2, 2, 4).micro_batches for k in range(2)]
    assert parts == [((8, 9), (12, 13)), ((10, 11), (14, 15))]
    assert rank_plan(plan, 0, 0, 2, 2, 4).micro_batches == ()  # not contributing: nothing to train
    with pytest.raises(ValueError, match="multiple of the ranks"):
        rank_plan(plan, 1, 0, 3, 2, 4)


def test_bad_input_is_refused_with_what_to_fix() -> None:
    with pytest.raises(ValueError, match="unknown data policy 'drop'"):
        plan_step(0, 2, [0], "drop")
    with pytest.raises(ValueError, match="no contributing replica"):
        plan_step(0, 2, [], SKIP)
    with pytest.raises(ValueError, match="step >= 0"):
        plan_step(-1, 2, [0], SKIP)


def test_catching_up_members_do_not_contribute() -> None:
    d = QuorumDecision(epoch=3, step=9, members=(0, 1, 2), behind=(1,), donors=((1, 0),))
    assert contributing_of(d) == (0, 2)


def test_account_counts_skipped_and_repeated_samples() -> None:
    acc = SampleAccount(3, 8, SKIP)
    for step, contributing in enumerate([[0, 1, 2], [0, 2], [0, 1, 2]]):
        acc.commit(acc.plan(step, contributing))
    assert (acc.samples_trained, acc.samples_skipped, acc.samples_repeated) == (8 * 8, 8, 0)
    saved = acc.state_dict()
    acc.commit(acc.plan(3, [0, 1, 2]))
    acc.load_state_dict(saved)  # back to step 3 (a rollback): training it again repeats its samples
    acc.commit(acc.plan(3, [0, 1, 2]))
    assert acc.samples_repeated == 24 and acc.next_step == 4


def test_account_under_constant_global_batch_skips_and_repeats_nothing() -> None:
    acc = SampleAccount(3, 8, CONSTANT_GLOBAL_BATCH)
    for step, contributing in enumerate(itertools.islice(itertools.cycle([[0, 1, 2], [0], [1, 2]]), 10)):
        acc.commit(acc.plan(step, contributing))
    assert (acc.samples_trained, acc.samples_skipped, acc.samples_repeated) == (10 * 24, 0, 0)


def test_a_committed_exchange_without_a_planned_replica_counts_its_slots_as_skipped() -> None:
    acc = SampleAccount(3, 8, CONSTANT_GLOBAL_BATCH)
    acc.commit(acc.plan(0, [0, 1, 2]), contributing=[0, 2])
    assert (acc.samples_trained, acc.samples_skipped) == (16, 8)


def test_a_peer_state_of_another_layout_is_refused() -> None:
    acc = SampleAccount(3, 8, SKIP)
    with pytest.raises(ValueError, match="sample order would not continue"):
        acc.load_state_dict(SampleAccount(3, 8, CONSTANT_GLOBAL_BATCH).state_dict())


def test_a_catching_up_replica_continues_the_donors_account() -> None:
    donor, fresh = SampleAccount(2, 4), SampleAccount(2, 4)
    for step in range(5):
        donor.commit(donor.plan(step, [0]))
    fresh.load_state_dict(donor.state_dict())
    for acc in (donor, fresh):
        acc.commit(acc.plan(5, [0]))  # the catch-up step: the newcomer is behind, replica 0 trains both slots
    assert fresh.state_dict() == donor.state_dict()
    assert fresh.samples_repeated == 0 and slot_samples(5, 1, 2, 4) == range(44, 48)
