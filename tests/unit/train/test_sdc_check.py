"""The exchange check at one member, its peers stood in for by the rows they add to the swap."""

from __future__ import annotations

from typing import Any

import torch

from unbroken.comm.cross_replica import ExchangeFailed
from unbroken.comm.fingerprint import fingerprint, fold
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.train.step.sdc_check import SDC_ERROR, ExchangeCheck, encode
from unbroken.train.step.sdc_judge import Prints

CPU = torch.device("cpu")


class SwapGroup:
    """Adds the peers' rows to the swapped tensor, as the members' sum would."""

    def __init__(self, peers: dict[int, Prints] | None = None, fail: bool = False) -> None:
        self.peers = peers or {}
        self.fail = fail
        self.last_failure: tuple[int | None, str] | None = None
        self.abortable: list[bool] = []

    def allreduce_sum(
        self, tensor: torch.Tensor, deadline_s: float, op: Any = None, abortable: bool = True, recorded: bool = True
    ) -> float:
        self.abortable.append(abortable)
        if self.fail:
            raise ExchangeFailed("a peer hung up")
        n = tensor.numel() // len(self.members)
        for replica, p in self.peers.items():
            tensor += encode(p, self.members.index(replica), len(self.members), CPU)
        assert n > 0
        return 0.001

    members: list[int] = []
    started: list[torch.Tensor]
    refuse_start = False
    sums_only = False  # a transport that sums one at a time (the ring): no side sum

    def start_side_sum(self, tensor: torch.Tensor) -> object:
        """The swap's start: the peers' rows are added when it is finished, as a backend would."""
        if self.refuse_start:
            raise ExchangeFailed("a peer hung up before the swap began")
        if self.sums_only:
            return None
        self.started = [*getattr(self, "started", []), tensor]
        return tensor

    def finish_side_sum(self, pending: torch.Tensor, deadline_s: float) -> float:
        assert self.started and self.started[-1] is pending
        self.started.pop()
        return self.allreduce_sum(pending, deadline_s, abortable=False, recorded=False)


def decision(members: tuple[int, ...], step: int = 5, behind: tuple[int, ...] = ()) -> QuorumDecision:
    return QuorumDecision(epoch=3, step=step, members=members, behind=behind)


def run(
    check: ExchangeCheck, group: SwapGroup, d: QuorumDecision, sent: torch.Tensor, got: torch.Tensor, **kw: Any
) -> bool:
    group.members = list(d.members)
    check.begin()
    check.sent(sent)
    check.received(got)
    return check.verify(group, 1.0, d, CPU, **kw)  # type: ignore[arg-type]


def test_agreeing_peers_commit_and_the_swap_ignores_aborts() -> None:
    sent, got = torch.ones(10), torch.full((10,), 3.0)
    result = fold([fingerprint(got)])
    group = SwapGroup({1: Prints(5, result), 2: Prints(6, result)})
    check = ExchangeCheck(0)
    assert run(check, group, decision((0, 1, 2)), sent, got)
    assert check.detected == 0 and check.last_result == result and check.completed(3, 5)
    assert group.abortable == [False]
    assert 0.0 < check.cpu_s and 0.0 < check.spent_s  # its own time, and of that its thread's CPU


def test_a_member_whose_sum_differs_from_the_majority_does_not_commit_and_says_why() -> None:
    got = torch.full((10,), 3.0)
    other = fold([fingerprint(torch.full((10,), 4.0))])
    group = SwapGroup({1: Prints(5, other), 2: Prints(6, other)})
    check = ExchangeCheck(0)
    assert not run(check, group, decision((0, 1, 2)), torch.ones(10), got)
    assert check.detected == 1 and check.findings[-1].judgement.culprits == (0,)
    assert (
        group.last_failure is not None and SDC_ERROR in group.last_failure[1] and "replica 0" in group.last_failure[1]
    )


def test_two_members_differ_then_a_rerun_names_the_culprit() -> None:
    sent, got = torch.ones(10), torch.full((10,), 3.0)
    mine = fold([fingerprint(got)])
    peer_in = 77
    check = ExchangeCheck(1)
    first = SwapGroup({0: Prints(peer_in, mine ^ 1)})
    assert not run(check, first, decision((0, 1)), sent, got)
    assert check.findings[-1].judgement.unresolved
    again = SwapGroup({0: Prints(peer_in, mine)})
    assert run(check, again, decision((0, 1)), sent, got)
    assert check.findings[-1].judgement.culprits == (0,) and check.findings[-1].judgement.named_by_rerun


def test_weights_are_checked_every_n_steps_and_not_by_a_member_catching_up() -> None:
    check = ExchangeCheck(0, weights_every=4)
    assert check.weights_due(decision((0, 1), step=8)) and not check.weights_due(decision((0, 1), step=9))
    assert not check.weights_due(decision((0, 1), step=8, behind=(0,)))
    # torchft's init_sync overwrites the replicas' differing first states in step 0: not compared
    assert check.weights_due(decision((0, 1), step=0))
    check.weights_from_step = 1
    assert not check.weights_due(decision((0, 1), step=0)) and check.weights_due(decision((0, 1), step=8))
    check.weights_from_step = 0
    got = torch.ones(4)
    result = fold([fingerprint(got)])
    calls: list[int] = []
    group = SwapGroup({1: Prints(1, result, 99), 2: Prints(2, result, 99)})

    def weights() -> int:
        calls.append(1)
        return 98

    assert not run(check, group, decision((0, 1, 2), step=8), got, got, weights=weights)
    assert calls == [1] and check.findings[-1].judgement.weights_differ


def test_a_failed_swap_does_not_commit_and_one_member_or_off_checks_nothing() -> None:
    check = ExchangeCheck(0)
    assert not run(check, SwapGroup(fail=True), decision((0, 1)), torch.ones(2), torch.ones(2))
    ring = SwapGroup(fail=True)
    ring.sums_only = True  # the swap is then the group's one-at-a-time sum, failing alike
    assert not run(check, ring, decision((0, 1)), torch.ones(2), torch.ones(2)) and ring.abortable == [False]
    assert run(check, SwapGroup(fail=True), decision((0,)), torch.ones(2), torch.ones(2))
    off = ExchangeCheck(0, enabled=False)
    assert run(off, SwapGroup(fail=True), decision((0, 1)), torch.ones(2), torch.ones(2))
    assert not off.completed(3, 5) and off.spent_s == off.cpu_s == 0.0


def test_a_swap_started_at_the_last_bucket_is_the_one_verify_judges() -> None:
    got = torch.full((10,), 3.0)
    result = fold([fingerprint(got)])
    check = ExchangeCheck(0)
    d = decision((0, 1, 2))
    group = SwapGroup({1: Prints(5, result), 2: Prints(6, result)})
    group.members = list(d.members)
    check.begin()
    check.sent(torch.ones(10))
    check.received(got)
    check.start(group, d, CPU)  # type: ignore[arg-type]
    assert len(group.started) == 1 and group.abortable == []  # in flight, nothing summed yet
    assert check.verify(group, 1.0, d, CPU)  # type: ignore[arg-type]
    assert group.started == [] and group.abortable == [False] and check.completed(3, 5)
    # A corrupted sum at this member is still caught through the early swap.
    other = fold([fingerprint(torch.full((10,), 4.0))])
    group = SwapGroup({1: Prints(5, other), 2: Prints(6, other)})
    group.members = list(d.members)
    check.begin()
    check.received(got)
    check.start(group, d, CPU)  # type: ignore[arg-type]
    assert not check.verify(group, 1.0, d, CPU)  # type: ignore[arg-type]
    assert check.findings[-1].judgement.culprits == (0,)


def test_a_bucket_after_the_early_swap_makes_every_member_swap_again() -> None:
    a, b = torch.full((10,), 3.0), torch.full((4,), 2.0)
    both = fold([fingerprint(a), fingerprint(b)])
    check = ExchangeCheck(0)
    d = decision((0, 1))
    group = SwapGroup({1: Prints(5, both)})
    group.members = list(d.members)
    check.begin()
    check.received(a)
    check.start(group, d, CPU)  # type: ignore[arg-type]
    check.received(b)  # another backward pass: the early prints are stale
    assert check.verify(group, 1.0, d, CPU)  # type: ignore[arg-type]
    assert group.abortable == [False, False] and check.last_result == both  # the early one, then a fresh one


def test_no_early_swap_when_weights_are_due_and_a_refused_start_fails_the_step() -> None:
    check = ExchangeCheck(0, weights_every=4)
    group = SwapGroup()
    group.members = [0, 1]
    check.begin()
    check.received(torch.ones(3))
    check.start(group, decision((0, 1), step=8), CPU)  # type: ignore[arg-type]
    assert not getattr(group, "started", [])  # not noted as the step began: read once backward is over
    refusing = SwapGroup()
    refusing.refuse_start = True
    refusing.members = [0, 1]
    check.begin()
    check.received(torch.ones(3))
    check.start(refusing, decision((0, 1), step=9), CPU)  # type: ignore[arg-type]
    assert not check.verify(refusing, 1.0, decision((0, 1), step=9), CPU)  # type: ignore[arg-type]
    assert refusing.abortable == []  # no second swap on a group that refused the first


def test_weights_noted_as_the_step_began_travel_in_the_early_swap() -> None:
    """``note_weights`` at the step's start (before forward): a step that checks the weights
    still starts its swap at the last bucket, with that fingerprint, and a diverged replica is
    named from it; other steps, a member catching up and a redo of another step take nothing."""
    got = torch.ones(4)
    result = fold([fingerprint(got)])
    calls: list[int] = []

    def weights() -> int:
        calls.append(1)
        return 98

    check = ExchangeCheck(0, weights_every=4)
    check.note_weights(9, weights)  # not a checking step
    assert calls == []
    check.note_weights(8, weights)
    assert calls == [1]
    d = decision((0, 1, 2), step=8)
    group = SwapGroup({1: Prints(1, result, 99), 2: Prints(2, result, 99)})
    group.members = list(d.members)
    check.begin()
    check.received(got)
    check.start(group, d, CPU)  # type: ignore[arg-type]
    assert len(group.started) == 1 and check.early_swaps == 1
    assert not check.verify(group, 1.0, d, CPU, weights=weights)  # type: ignore[arg-type]
    assert calls == [1]  # not read again after backward
    assert check.findings[-1].judgement.weights_differ and check.findings[-1].judgement.culprits == (0,)
    # Catching up in the step it noted: its state is being replaced, nothing is compared.
    behind = decision((0, 1, 2), step=8, behind=(0,))
    group = SwapGroup({1: Prints(1, result, 99), 2: Prints(2, result, 99)})
    group.members = list(behind.members)
    check.begin()
    check.received(got)
    check.start(group, behind, CPU)  # type: ignore[arg-type]
    assert check.verify(group, 1.0, behind, CPU, weights=weights)  # type: ignore[arg-type]
    # A print noted for another step is not used: the weights are read in verify.
    check.note_weights(12, weights)
    group = SwapGroup({1: Prints(1, result, 98), 2: Prints(2, result, 98)})
    group.members = list(d.members)
    check.begin()
    check.received(got)
    check.start(group, decision((0, 1, 2), step=16), CPU)  # type: ignore[arg-type]
    assert not getattr(group, "started", [])
    assert check.verify(group, 1.0, decision((0, 1, 2), step=16), CPU, weights=weights)  # type: ignore[arg-type]
    assert calls == [1, 1, 1]
