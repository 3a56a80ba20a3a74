"""Who commits and who is named when the members' fingerprints of an exchange differ."""

from __future__ import annotations

import pytest
import torch

from unbroken.train.step.sdc_check import decode, encode
from unbroken.train.step.sdc_judge import Attempt, Prints, judge, majority, named_by_rerun


def same(n: int, result: int = 7, weights: int | None = None) -> dict[int, Prints]:
    return {r: Prints(input=100 + r, result=result, weights=weights) for r in range(n)}


def test_agreeing_results_commit_everywhere_and_name_nobody() -> None:
    for me in range(3):
        j = judge(same(3), me)
        assert j.commit and not j.detected and j.culprits == ()


def test_a_minority_result_is_named_and_only_it_does_not_commit() -> None:
    prints = same(4) | {2: Prints(102, 9)}
    for me in range(4):
        j = judge(prints, me)
        assert j.results_differ and j.culprits == (2,) and not j.unresolved
        assert j.commit == (me != 2)


def test_two_members_that_differ_commit_nothing_until_a_rerun_names_the_culprit() -> None:
    first = {0: Prints(10, 7), 1: Prints(11, 8)}
    for me in (0, 1):
        j = judge(first, me, layout=(5,), step=3)
        assert not j.commit and j.unresolved and j.culprits == ()
    previous = Attempt(3, (5,), first)
    rerun = {0: Prints(10, 7), 1: Prints(11, 7)}  # same inputs, and the results agree now
    for me in (0, 1):
        j = judge(rerun, me, layout=(5,), previous=previous, step=3)
        assert j.commit and j.culprits == (1,) and j.named_by_rerun and not j.results_differ


def test_a_rerun_names_nobody_unless_it_summed_the_same_inputs() -> None:
    previous = Attempt(3, (5,), {0: Prints(10, 7), 1: Prints(11, 8)})
    agreed = {0: Prints(10, 7), 1: Prints(11, 7)}
    assert named_by_rerun(previous, 3, (5,), agreed) == (1,)
    assert named_by_rerun(previous, 4, (5,), agreed) == ()  # another step
    assert named_by_rerun(previous, 3, (6,), agreed) == ()  # another layout of buffers
    assert named_by_rerun(previous, 3, (5,), {0: Prints(10, 7), 1: Prints(12, 7)}) == ()  # new gradients
    assert named_by_rerun(previous, 3, (5,), agreed | {2: Prints(0, 7)}) == ()  # a newcomer joined
    assert named_by_rerun(previous, 3, (5,), {0: Prints(10, 7), 1: Prints(11, 9)}) == ()  # still differ
    assert named_by_rerun(None, 3, (5,), agreed) == ()


def test_a_three_way_split_commits_nothing() -> None:
    prints = {0: Prints(1, 5), 1: Prints(2, 6), 2: Prints(3, 7)}
    assert all(not judge(prints, me).commit and judge(prints, me).unresolved for me in range(3))


def test_diverged_weights_name_the_minority_which_does_not_commit() -> None:
    prints = same(3, weights=42) | {0: Prints(100, 7, 41)}
    for me in range(3):
        j = judge(prints, me)
        assert j.weights_differ and not j.results_differ and j.culprits == (0,)
        assert j.commit == (me != 0)


def test_two_replicas_with_diverged_weights_are_reported_without_a_culprit() -> None:
    prints = {0: Prints(1, 7, 41), 1: Prints(2, 7, 42)}
    j = judge(prints, 0)
    assert j.weights_differ and j.culprits == () and j.commit  # nothing tells the healthy copy


def test_weights_are_compared_among_the_members_that_checked_them() -> None:
    prints = {0: Prints(1, 7, 41), 1: Prints(0, 7, None), 2: Prints(3, 7, 41), 3: Prints(4, 7, 40)}
    for me in range(4):  # replica 1 catches up this step: its weights are not loaded yet
        j = judge(prints, me)
        assert j.weights_differ and j.culprits == (3,) and j.commit == (me != 3)
    assert not judge({0: Prints(1, 7, 41), 1: Prints(0, 7, None)}, 1).weights_differ


def test_majority_needs_more_than_half() -> None:
    assert majority({0: 1, 1: 1, 2: 2}) == 1
    assert majority({0: 1, 1: 2}) is None
    assert majority({0: 1, 1: 1, 2: 2, 3: 2}) is None
    assert majority({}) is None


def test_unknown_member_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="replica 5 is not among"):
        judge(same(2), 5)


def test_fingerprints_survive_a_float32_sum_bit_for_bit() -> None:
    members = [4, 0, 9]
    big = (1 << 64) - 1
    prints = [Prints(big, 1 << 63, None), Prints(0, 12345678901234567, 3), Prints(77, big - 5, 0)]
    total = sum(encode(p, i, len(members), device=torch.device("cpu")) for i, p in enumerate(prints))
    got = decode(total.tolist(), members)
    assert got == {4: prints[0], 0: prints[1], 9: prints[2]}


def test_a_garbled_fingerprint_sum_is_refused() -> None:
    t = encode(Prints(1, 2), 0, 2, torch.device("cpu"))  # the other member never wrote its row
    assert decode(t.tolist(), [0, 1]) is None
    t2 = t + encode(Prints(1, 2), 1, 2, torch.device("cpu"))
    assert decode(t2.tolist(), [0, 1]) is not None
    t2[3] += 0.5
    assert decode(t2.tolist(), [0, 1]) is None
    assert decode(t2.tolist()[:-1], [0, 1]) is None
