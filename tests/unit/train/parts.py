"""Stand-ins for the parts a Manager is given (unbroken.train.factory builds the real ones): a
coordinator that grants every request a one-member quorum at once, and a one-member group whose
sum of a buffer is the buffer itself. The integration tests run the real parts; these let a unit
test drive the Manager's step logic through its constructor. test_fakes_match_manager.py checks
their methods against the real classes."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import torch

from unbroken.comm.cross_replica import ExchangeFailed
from unbroken.config import ReplicaConfig
from unbroken.control.client import DRAIN_S
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.control.quorum.silence import SilenceWatch
from unbroken.train.manager import Manager
from unbroken.wire.auth import JobSecret

SECRET = JobSecret(b"k" * 32)


class FakeClient:
    """Records each quorum request as (step, failed epoch) and grants it at once, in a new epoch."""

    def __init__(self, replica_id: int = 0) -> None:
        self.replica_id = replica_id
        self.asked: list[tuple[int, int | None]] = []
        self.answers: list[Future[dict[str, Any]]] = []
        self.silence = SilenceWatch()
        self.compute_s: float | None = None
        self.store_address: str | None = "127.0.0.1:1"
        self.closed: bool | None = None
        self.drained = 0
        self.pushed_after: tuple[int, int] | None = None  # (epoch aborted, step its pushed successor trains)

    def request_quorum(
        self,
        step: int,
        failed_epoch: int | None = None,
        step_time: float | None = None,
        failure: str | None = None,
    ) -> Future[dict[str, Any]]:
        self.asked.append((step, failed_epoch))
        decision = QuorumDecision(epoch=len(self.asked), step=step, members=(self.replica_id,))
        fut: Future[dict[str, Any]] = Future()
        fut.set_result({"decision": decision.to_json()})
        self.answers.append(fut)
        return fut

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        self.drained += 1

    def next_step_after(self, epoch: int) -> int | None:
        return self.pushed_after[1] if self.pushed_after is not None and self.pushed_after[0] >= epoch else None

    def close(self, finished: bool = True) -> None:
        self.closed = finished


class FakeGroup:
    """A group of this replica alone: the sum is the buffer; with ``fail`` every exchange fails."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.epoch: int | None = None
        self.aborted: int | None = None  # the last epoch aborted
        self.last_failure: tuple[int | None, str] | None = None
        self.last_join_wait_s = 0.0
        self.overlaps = False
        self.closed = False

    def configure(
        self,
        store_address: str,
        epoch: int,
        rank: int,
        size: int,
        tag: str,
        device: torch.device,
        members: list[int] | None = None,
    ) -> None:
        self.epoch = epoch

    def allreduce_sum(
        self, tensor: torch.Tensor, deadline_s: float, op: Any = None, abortable: bool = True, recorded: bool = True
    ) -> float:
        if self.fail:
            self.last_failure = (self.epoch, "a peer hung up")
            raise ExchangeFailed("a peer hung up")
        return 0.001

    def abort(self, epoch: int) -> None:
        self.aborted = epoch

    def superseded(self) -> bool:
        return self.epoch is not None and self.aborted is not None and self.aborted >= self.epoch

    def close(self, timeout_s: float = 0.0) -> None:
        self.closed = True


def fake_server() -> Any:
    """A catch-up server that serves nothing (a one-member job has no peer to serve)."""
    return SimpleNamespace(pool=SimpleNamespace(prewarm=lambda nbytes: None), address="127.0.0.1:1", close=lambda: None)


def manager_with_fakes(
    client: FakeClient | None = None, group: FakeGroup | None = None, **kwargs: Any
) -> tuple[Manager, FakeClient, FakeGroup]:
    """A Manager of replica 0 in a one-replica job, built through its constructor with stand-ins."""
    client = client or FakeClient()
    group = group or FakeGroup()
    config = ReplicaConfig(coordinator="127.0.0.1:1", replica_id=client.replica_id, num_replicas=1)
    m = Manager(
        config=config,
        client=client,  # type: ignore[arg-type]
        group=group,  # type: ignore[arg-type]
        catchup=fake_server(),
        secret=SECRET,
        **kwargs,
    )
    return m, client, group
