"""Which agent runs which replica: hand-out order, spares, and what an agent's death moves."""

from __future__ import annotations

import pytest

from unbroken.control.nodes.assignment import Assignment


def test_replicas_are_handed_out_lowest_first_and_leftover_slots_are_spares() -> None:
    a = Assignment(total_replicas=3)
    assert a.join("a", 2) == [0, 1]
    assert a.join("b", 2) == [2]
    assert a.join("c", 1) == []
    assert (a.free("a"), a.free("b"), a.free("c")) == (0, 1, 1)


def test_a_dead_agents_replicas_move_to_free_slots_most_free_first() -> None:
    a = Assignment(total_replicas=3)
    a.join("a", 2)
    a.join("b", 1)
    a.join("c", 1)
    a.join("d", 2)
    lost, moves = a.leave("a")
    assert lost == [0, 1]
    assert moves == {"d": [0, 1]}
    assert a.replicas_of("d") == [0, 1] and "a" not in a.slots


def test_without_spares_the_lost_replicas_are_left_unassigned() -> None:
    a = Assignment(total_replicas=2)
    a.join("a", 1)
    a.join("b", 1)
    lost, moves = a.leave("b")
    assert (lost, moves) == ([1], {})
    assert a.unassigned() == [1]
    assert a.join("late", 1) == [1]  # a node that joins later takes it


def test_finished_replicas_are_not_moved() -> None:
    a = Assignment(total_replicas=2)
    a.join("a", 2)
    a.join("b", 2)
    lost, moves = a.leave("a", done={0})
    assert (lost, moves) == ([0, 1], {"b": [1]})


def test_bad_joins_say_what_to_fix() -> None:
    a = Assignment(total_replicas=2)
    a.join("a", 1)
    with pytest.raises(ValueError, match="already connected.*own --node"):
        a.join("a", 1)
    with pytest.raises(ValueError, match="at least one slot"):
        a.join("b", 0)


def test_after_a_coordinator_restart_agents_keep_what_they_run() -> None:
    a = Assignment(total_replicas=3)
    # b comes back first with replica 1; replica 0's workers are connected but a is not back yet
    assert a.join("b", 2, running=[1], busy={0, 1}) == [1, 2]
    assert a.join("a", 1, running=[0]) == [0]
    # a claim beyond the job's replicas, or of a replica another agent holds, is not granted
    assert a.join("c", 2, running=[1, 7]) == []


def test_replica_groups_take_k_distinct_nodes_and_a_spare_replaces_a_lost_one() -> None:
    from unbroken.control.nodes.assignment import GroupAssignment

    a = GroupAssignment(total_replicas=2, nodes_per_replica=2)
    assert a.join("a", 1) == []  # half a group: not started
    assert a.join("b", 1) == [0]
    assert a.join("c", 1) == []
    assert a.join("d", 1) == [1]
    assert a.join("e", 1) == []  # a spare
    assert a.members == {0: ["a", "b"], 1: ["c", "d"]}
    first = a.incarnation[1]
    hit, started = a.leave("d")
    assert hit == [1] and started == [1]
    assert a.members[1] == ["c", "e"]  # c keeps group rank 0: it is not blamed
    assert a.incarnation[1] > first


def test_a_group_without_a_spare_waits_with_a_hole_and_a_released_node_is_not_matched_again() -> None:
    from unbroken.control.nodes.assignment import GroupAssignment

    a = GroupAssignment(total_replicas=1, nodes_per_replica=2)
    a.join("a", 1)
    a.join("b", 1)
    assert a.leave("b") == ([0], [])
    assert a.members[0] == ["a", None] and not a.complete(0)
    assert a.join("c", 1) == [0] and a.members[0] == ["a", "c"]
    a.join("d", 1)
    assert a.release("c", 0) == [0] and a.members[0] == ["a", "d"]
    a.leave("d")
    assert a.members[0] == ["a", None]  # c gave up on replica 0: never matched to it again


def test_a_finished_replica_is_never_handed_out_again() -> None:
    # Replica 0 finished and its agent left; an agent that joins (or rejoins saying it runs 0)
    # must not be given it: started anew it would train from step 0 without its checkpoint.
    a = Assignment(total_replicas=3)
    assert a.join("h0", 1) == [0] and a.join("h1", 1) == [1]
    a.leave("h0", done={0})
    assert a.join("h2", 2, done={0}) == [2]
    assert a.join("h0", 1, running=[0], done={0}) == []
