"""The next step's quorum can be asked for once this step's exchange succeeded, before its commit.

The coordinator and the group are stand-ins (tests/unit/train/parts.py; the integration tests run
the real ones): these tests pin which step each request names, which the coordinator's quorum
rules depend on.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.train.parts import FakeClient, manager_with_fakes
from unbroken.train.manager import Manager


def manager_at_step(step: int, exchange_ok: bool) -> tuple[Manager, FakeClient]:
    """A Manager that committed its first step, now at ``step``, whose next exchanges answer ``exchange_ok``."""
    m, client, group = manager_with_fakes(max_attempts=1)
    weight = torch.zeros(2)
    m.register_state_dict_fn("w", lambda s: weight.copy_(s), lambda: weight)
    m.step = step - 1
    m.start_step()
    assert m.sync_gradients([torch.zeros(2)])
    m.commit()
    assert m.step == step
    client.asked.clear()
    client.answers.clear()
    group.fail = not exchange_ok
    return m, client


def test_a_step_that_will_commit_asks_for_the_next_one_before_its_commit() -> None:
    m, client = manager_at_step(3, exchange_ok=True)
    assert m.sync_gradients([torch.zeros(2)])
    assert client.asked == [(3, None)]  # sync_gradients asks nothing more: the loop may not commit
    m.request_next_quorum()
    assert client.asked == [(3, None), (4, None)]  # sent before the optimizer steps
    m.commit()
    m.start_step()
    assert client.asked == [(3, None), (4, None)], "start_step asked again instead of using the early request"
    assert m.wait_quorum().epoch == 2  # the step runs under the answer to the early request


def test_a_step_that_may_not_commit_cannot_ask_for_the_next_one() -> None:
    m, client = manager_at_step(3, exchange_ok=False)
    assert not m.sync_gradients([torch.zeros(2)])
    with pytest.raises(RuntimeError, match="sync_gradients\\(\\) returned True"):
        m.request_next_quorum()
    assert client.asked == [(3, None)]
    m.start_step()  # the loop's next attempt of the same step
    assert client.asked == [(3, None), (3, None)]


def test_a_replica_that_does_not_commit_asks_for_the_step_it_did_not_apply() -> None:
    m, client = manager_at_step(3, exchange_ok=True)
    assert m.sync_gradients([torch.zeros(2)])
    m.request_next_quorum()
    m.start_step()  # no commit: the early answer is for a step this replica has not reached
    assert client.asked == [(3, None), (4, None), (3, None)]
    assert m.wait_quorum().epoch == 3 and m.wait_quorum().step == 3


def test_a_fresh_process_does_not_ask_early_while_a_fetch_may_write_into_its_tensors() -> None:
    m, client, _ = manager_with_fakes()
    m.register_state_dict_fn("w", lambda s: None, lambda: torch.zeros(2))
    assert m.sync_gradients([torch.zeros(2)])  # its first step: its tensors were noted to fetch into
    m.request_next_quorum()
    assert client.asked == [(0, None)]  # the next start_step asks, as it always did


def test_it_is_asked_once_per_step() -> None:
    m, client = manager_at_step(3, exchange_ok=True)
    assert m.sync_gradients([torch.zeros(2)])
    m.request_next_quorum()
    with pytest.raises(RuntimeError):
        m.request_next_quorum()
    assert client.asked == [(3, None), (4, None)]
