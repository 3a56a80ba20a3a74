"""A step whose sum completed is not applied once the coordinator has aborted its epoch.

The peers that gave up on the exchange redo the step without this replica; applying it here too
would train its samples twice (tests/integration/test_data_accounting.py saw it after a SIGSTOP).
The coordinator and the group are stand-ins (tests/unit/train/parts.py).
"""

from __future__ import annotations

import torch

from tests.unit.train.parts import FakeGroup, manager_with_fakes


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
