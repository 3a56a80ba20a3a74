"""The next step's quorum can be asked for once this step's exchange succeeded, before its commit.

The coordinator is a fake that records requests (the integration tests run the real one): these
tests pin which step each request names, which the coordinator's quorum rules depend on.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from unbroken.train.manager import Manager


class RecordingClient:
    def __init__(self) -> None:
        self.asked: list[tuple[int, int | None]] = []
        self.answers: list[Future[dict[str, Any]]] = []

    def request_quorum(
        self,
        step: int,
        failed_epoch: int | None = None,
        step_time: float | None = None,
        failure: str | None = None,
    ) -> Future[dict[str, Any]]:
        self.asked.append((step, failed_epoch))
        self.answers.append(Future())
        return self.answers[-1]


def manager_at_step(step: int, exchange_ok: bool) -> tuple[Manager, RecordingClient]:
    """A Manager past its first commit whose exchange of ``step`` answers ``exchange_ok``."""
    m = Manager.__new__(Manager)
    client = RecordingClient()
    m.client = client  # type: ignore[assignment]
    m.group = SimpleNamespace(last_failure=None)  # type: ignore[assignment]
    m.step = step
    m._quorum = None
    m._next_quorum = None
    m._own_state = None
    m._fetch = None
    m._snapshot = None
    m._donate_next = False
    m._last_commit = 1.0
    m._step_time = 0.5
    m._step_began = 0.0
    m.prepare_early = False
    m._may_commit = False
    m.fault_hook = None
    m._sync_gradients = lambda grads: exchange_ok  # type: ignore[method-assign]
    return m, client


def test_a_step_that_will_commit_asks_for_the_next_one_before_its_commit() -> None:
    m, client = manager_at_step(3, exchange_ok=True)
    assert m.sync_gradients([torch.zeros(2)])
    assert client.asked == []  # sync_gradients alone asks nothing: the loop may not commit
    m.request_next_quorum()
    assert client.asked == [(4, None)]  # sent before the optimizer steps
    m.step += 1  # what commit() does to the step count
    m.start_step()
    assert client.asked == [(4, None)], "start_step asked again instead of using the early request"
    assert m._quorum is client.answers[0]


def test_a_step_that_may_not_commit_cannot_ask_for_the_next_one() -> None:
    m, client = manager_at_step(3, exchange_ok=False)
    assert not m.sync_gradients([torch.zeros(2)])
    with pytest.raises(RuntimeError, match="sync_gradients\\(\\) returned True"):
        m.request_next_quorum()
    assert client.asked == []
    m.start_step()  # the loop's next attempt of the same step
    assert client.asked == [(3, None)]


def test_a_replica_that_does_not_commit_asks_for_the_step_it_did_not_apply() -> None:
    m, client = manager_at_step(3, exchange_ok=True)
    assert m.sync_gradients([torch.zeros(2)])
    m.request_next_quorum()
    m.start_step()  # no commit: the early answer is for a step this replica has not reached
    assert client.asked == [(4, None), (3, None)]
    assert m._quorum is client.answers[1]


def test_a_fresh_process_does_not_ask_early_while_a_fetch_may_write_into_its_tensors() -> None:
    m, client = manager_at_step(0, exchange_ok=True)
    m._own_state = {"user": {}}  # noted at its first start_step, cleared by its first commit
    assert m.sync_gradients([torch.zeros(2)])
    m.request_next_quorum()
    assert client.asked == []  # the next start_step asks, as it always did


def test_it_is_asked_once_per_step() -> None:
    m, client = manager_at_step(3, exchange_ok=True)
    assert m.sync_gradients([torch.zeros(2)])
    m.request_next_quorum()
    with pytest.raises(RuntimeError):
        m.request_next_quorum()
    assert client.asked == [(4, None)]
