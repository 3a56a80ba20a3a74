"""A step whose sum completed is not applied once the coordinator has aborted its epoch.

The peers that gave up on the exchange redo the step without this replica; applying it here too
would train its samples twice (tests/integration/test_data_accounting.py saw it after a SIGSTOP).
The coordinator and the group are stand-ins (tests/unit/train/parts.py).
"""

from __future__ import annotations

import torch

from tests.unit.train.parts import SECRET, FakeGroup, manager_with_fakes
from unbroken.comm.cross_replica import CrossReplicaGroup


class AbortedAsItSums(FakeGroup):
    """The coordinator's abort of the first epoch arrives while its sum completes."""

    def allreduce_sum(self, tensor: torch.Tensor, deadline_s: float) -> float:
        if self.epoch == 1:
            self.abort(self.epoch)
        return super().allreduce_sum(tensor, deadline_s)


def test_a_sum_that_completed_in_an_aborted_epoch_is_not_committed() -> None:
    m, client, _ = manager_with_fakes(group=AbortedAsItSums())
    assert m.sync_gradients([torch.zeros(2)])
    assert client.drained == 2  # what had arrived from the coordinator was read before each vote
    assert client.asked == [(0, None), (0, 1)]  # the step again, without the epoch it was summed in


def test_an_abort_of_an_earlier_epoch_does_not_stop_this_one() -> None:
    m, client, group = manager_with_fakes(max_attempts=1)
    group.abort(0)
    assert m.sync_gradients([torch.zeros(2)])
    m.commit()
    assert m.step == 1


def test_a_step_summed_everywhere_before_a_death_is_committed() -> None:
    # A member died after the step's sum completed on every replica: the epoch pushed with the
    # abort trains the next step, so the peers applied this one, and so does this replica.
    m, client, _ = manager_with_fakes(group=AbortedAsItSums())
    client.pushed_after = (1, 1)  # epoch 1 aborted; its successor trains step 1
    assert m.sync_gradients([torch.zeros(2)])
    assert client.asked == [(0, None)]  # committed in epoch 1: not asked again
    m.commit()
    assert m.step == 1


def test_the_groups_epoch_is_superseded_by_its_abort_or_a_later_one() -> None:
    group = CrossReplicaGroup(SECRET)
    group.configure("127.0.0.1:1", epoch=4, rank=0, size=1, tag="t", device=torch.device("cpu"))
    assert not group.superseded()
    group.abort(3)  # an older epoch's abort, read late
    assert not group.superseded()
    group.abort(4)
    assert group.superseded()
    group.configure("127.0.0.1:1", epoch=5, rank=0, size=1, tag="t", device=torch.device("cpu"))
    assert not group.superseded()
    group.abort(6)
    assert group.superseded()


def test_a_reported_error_vetoes_the_step_once_and_is_not_redone() -> None:
    # torchft's report_error: the exchange succeeded, but this replica's gradients are not to
    # be applied; the step goes back to the loop (no redo with the same gradients) and the
    # next attempt asks for a quorum without the epoch.
    m, client, _ = manager_with_fakes()
    m.report_error(RuntimeError("a corrupt side computation"))
    assert isinstance(m.errored, RuntimeError)
    assert not m.sync_gradients([torch.zeros(2)])
    assert m.errored is None  # the veto held for that one vote
    assert client.asked == [(0, None), (0, 1)]
    assert m.sync_gradients([torch.zeros(2)])
    m.commit()
    assert m.step == 1
