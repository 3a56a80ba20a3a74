"""An epoch's cross-replica group built ahead of the epoch, from the coordinator's forecast
(``CrossReplicaGroup.prepare``): taken when the epoch forms as forecast, never met otherwise."""

from __future__ import annotations

import threading
from typing import Any

import torch

from unbroken.comm.cross_replica import CrossReplicaGroup, epoch_name
from unbroken.comm.transport import EpochLink, Transport
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer

SECRET = JobSecret(b"p" * 32)
CPU = torch.device("cpu")


def _members(work: Any, n: int = 2) -> list[Any]:
    results: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except Exception as e:  # handed to the assertion
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_a_group_built_ahead_is_taken_when_the_epoch_forms_as_forecast() -> None:
    server = StoreServer("127.0.0.1", SECRET)
    try:

        def member(rank: int) -> tuple[int, list[float], int, list[float]]:
            group = CrossReplicaGroup(SECRET, timeout_s=10.0)
            try:
                # forecast: epoch 2 of replicas 0 and 1 (this thread is replica `rank`)
                assert group.prepare(server.address, 2, [0, 1], rank, "t", CPU)
                assert not group.prepare(server.address, 2, [0, 1], rank, "t", CPU)  # once per forecast
                group.configure(server.address, 2, rank, 2, tag="t", device=CPU, members=[0, 1])
                t = torch.full((3,), float(rank + 1))
                group.allreduce_sum(t, deadline_s=10.0)
                hits = group.prepared_hits
                # a forecast that missed: epoch 3 was to take a newcomer (2) that never came
                assert group.prepare(server.address, 3, [0, 1, 2], rank, "t", CPU)
                group.configure(server.address, 3, rank, 2, tag="t", device=CPU, members=[0, 1])
                u = torch.full((2,), float(10 * (rank + 1)))
                group.allreduce_sum(u, deadline_s=10.0)
                return hits, t.tolist(), group.prepared_hits, u.tolist()
            finally:
                group.close()

        results = _members(member)
    finally:
        server.close()
    for r in results:
        assert not isinstance(r, Exception), r
    assert [r[0] for r in results] == [1, 1]  # epoch 2's group was the one built ahead
    assert all(r[1] == [3.0, 3.0, 3.0] for r in results)
    assert [r[2] for r in results] == [1, 1]  # epoch 3 was built when it formed
    assert all(r[3] == [30.0, 30.0] for r in results)


def test_a_forecast_is_ignored_by_a_replica_outside_it_or_for_an_epoch_already_past() -> None:
    group = CrossReplicaGroup(SECRET)
    try:
        assert not group.prepare("127.0.0.1:1", 4, [0, 1], 2, "t", CPU)  # not a member
        assert not group.prepare("127.0.0.1:1", 4, [2], 2, "t", CPU)  # a group of one builds nothing
        group.configure("127.0.0.1:1", 5, 0, 1, tag="t", device=CPU, members=[2])
        assert not group.prepare("127.0.0.1:1", 5, [1, 2], 2, "t", CPU)  # epoch 5 is here already
    finally:
        group.close()


def test_each_membership_of_an_epoch_meets_under_its_own_name() -> None:
    assert epoch_name("t", 3, [0, 1, 2]) != epoch_name("t", 3, [0, 1])
    assert epoch_name("t", 3, [0, 1]) == epoch_name("t", 3, [0, 1]) != epoch_name("t", 4, [0, 1])
    assert epoch_name("rank0", 3, [0, 1]).startswith("rank0/epoch3/")


class NamingTransport(Transport):
    """Builds nothing: records each epoch name a build asked for (a name must be built once)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.released: list[Any] = []

    def build(self, link: EpochLink) -> tuple[str, Any]:
        self.names.append(link.tag_epoch)
        return "gloo", object()

    def start(self, *args: Any) -> Any:
        raise AssertionError("no sum here")

    def release(self, reaper: Any, pg: Any, backend: str, epoch: int | None, works: list[Any]) -> None:
        self.released.append(pg)


def _settled(group: CrossReplicaGroup) -> None:
    for pending in list(group._prepared.values()) + ([group._pending] if group._pending else []):
        try:
            pending.result(timeout=10)
        except Exception:  # noqa: BLE001 - a failed build counts as settled
            pass


def test_forecasts_that_change_never_build_one_epoch_name_twice() -> None:
    transport = NamingTransport()
    group = CrossReplicaGroup(SECRET, transport=transport)
    store = "127.0.0.1:1"
    try:
        group.configure(store, 2, 0, 2, tag="t", device=CPU, members=[0, 1])
        # epoch 4 forecast with a newcomer, then epoch 3 forms first without it: kept for 4
        assert group.prepare(store, 4, [0, 1, 2], 0, "t", CPU)
        _settled(group)
        group.configure(store, 3, 0, 2, tag="t", device=CPU, members=[0, 1])
        _settled(group)
        group.configure(store, 4, 0, 3, tag="t", device=CPU, members=[0, 1, 2])
        assert group.prepared_hits == 1
        assert transport.names.count(epoch_name("t", 4, [0, 1, 2])) == 1
        # forecast 6 with 2, then with 3 instead, then 6 forms with 2 after all: built ahead once
        # and released, its name is not built again; the epoch fails and the next one forms
        assert group.prepare(store, 6, [0, 1, 2], 0, "t", CPU)
        for extra in (3, 4, 5, 6):  # forecasts past MAX_PREPARED push out the first
            assert group.prepare(store, 6, [0, 1, extra], 0, "t", CPU)
        assert not group.prepare(store, 6, [0, 1, 2], 0, "t", CPU)  # its name was started once
        _settled(group)
        group.configure(store, 6, 0, 3, tag="t", device=CPU, members=[0, 1, 2])
        assert group._pending is not None and group._pending.exception() is not None
        assert transport.names.count(epoch_name("t", 6, [0, 1, 2])) == 1
        assert len(group._prepared) == 0  # every forecast of epoch 6 released
    finally:
        group.close()


def test_a_replica_no_epoch_takes_in_remembers_a_bounded_number_of_forecasts() -> None:
    """A parked spare hears forecasts that never form; what it keeps of them stays bounded."""
    from unbroken.comm.cross_replica import MAX_PREPARED, MAX_STARTED_AHEAD

    group = CrossReplicaGroup(SECRET, transport=NamingTransport())
    try:
        for epoch in range(1, MAX_STARTED_AHEAD + 20):
            assert group.prepare("127.0.0.1:1", epoch, [0, 1], 1, "t", CPU)
        assert len(group._started_ahead) == MAX_STARTED_AHEAD and len(group._prepared) == MAX_PREPARED
    finally:
        group.close()
