"""Several sums in flight on a real two-member Gloo group (two threads of this process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from unbroken.comm.cross_replica import CrossReplicaGroup, ExchangeFailed
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer

SECRET = JobSecret.generate()


def _pair(epoch: int) -> tuple[CrossReplicaGroup, CrossReplicaGroup, StoreServer]:
    server = StoreServer("127.0.0.1", SECRET)
    groups = (CrossReplicaGroup(SECRET, timeout_s=5.0), CrossReplicaGroup(SECRET, timeout_s=5.0))
    for rank, g in enumerate(groups):
        g.configure(server.address, epoch, rank, 2, tag="test", device=torch.device("cpu"))
    return groups[0], groups[1], server


def _both(a: Callable[[], Any], b: Callable[[], Any]) -> tuple[Any, Any]:
    out: list[Any] = [None, None]

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            out[i] = fn()
        except Exception as e:  # handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out[0], out[1]


def _buckets(g: CrossReplicaGroup, values: list[float], started: int | None = None) -> tuple[list[torch.Tensor], float]:
    bufs = [torch.full((1000,), v) for v in values]
    pending = [g.start_allreduce_sum(b, 5.0) for b in bufs[:started]]
    return bufs, g.finish_allreduce_sums(pending, 1.0)


def test_sums_in_flight_all_complete() -> None:
    a, b, _server = _pair(1)
    (bufs_a, _), (bufs_b, _) = _both(lambda: _buckets(a, [1.0, 2.0, 3.0]), lambda: _buckets(b, [10.0, 20.0, 30.0]))
    for bufs in (bufs_a, bufs_b):
        assert [t[0].item() for t in bufs] == [11.0, 22.0, 33.0]
    ones = torch.ones(3), torch.ones(3)
    _both(lambda: a.allreduce_sum(ones[0], 5.0), lambda: b.allreduce_sum(ones[1], 5.0))
    assert ones[0].tolist() == [2.0, 2.0, 2.0]  # the one-shot exchange still works after a batch


def test_a_peer_that_never_starts_a_bucket_fails_the_wait_at_its_deadline() -> None:
    a, b, _server = _pair(1)
    # b starts only the first of the two buckets a starts (it died or hung in between).
    ra, rb = _both(lambda: _buckets(a, [1.0, 2.0]), lambda: _buckets(b, [1.0, 2.0], started=1))
    assert isinstance(ra, ExchangeFailed) and "deadline" in str(ra)
    assert not isinstance(rb, Exception)
    assert a.epoch is None  # abandoned: never used again
    with pytest.raises(ExchangeFailed):
        a.start_allreduce_sum(torch.ones(3), 1.0)


def test_the_coordinators_abort_ends_the_wait_at_once() -> None:
    a, b, _server = _pair(7)
    _both(lambda: a.allreduce_sum(torch.ones(3), 5.0), lambda: b.allreduce_sum(torch.ones(3), 5.0))  # built
    pending = [a.start_allreduce_sum(torch.ones(1000), 5.0)]  # b never joins this one
    threading.Timer(0.2, a.abort, args=(7,)).start()
    began = time.monotonic()
    with pytest.raises(ExchangeFailed, match="aborted"):
        a.finish_allreduce_sums(pending, 20.0)
    assert time.monotonic() - began < 10.0  # not the 20 s deadline


def test_a_side_sum_a_peer_never_starts_fails_at_its_deadline() -> None:
    a, b, _server = _pair(4)
    _both(lambda: _buckets(a, [1.0]), lambda: _buckets(b, [1.0]))
    pending = a.start_side_sum(torch.ones(4))
    assert pending is not None
    began = time.monotonic()
    with pytest.raises(ExchangeFailed, match="deadline"):
        a.finish_side_sum(pending, 0.5)
    assert time.monotonic() - began < 5.0 and a.epoch is None  # abandoned
    alone = CrossReplicaGroup(SECRET, timeout_s=5.0)
    assert alone.start_side_sum(torch.ones(4)) is None  # no group: the caller sums the old way


def test_rows_are_gathered_into_every_members_tensor() -> None:
    a, b, _server = _pair(5)
    rows = torch.tensor([1.0, 2.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 3.0, 4.0])  # member 0's, member 1's

    def member(g: CrossReplicaGroup, t: torch.Tensor, pause: float) -> float:
        _buckets(g, [1.0])
        time.sleep(pause)  # one starts as its last bucket lands, the other later
        pending = g.start_side_sum(t)
        assert pending is not None
        return g.finish_side_sum(pending, 5.0)

    ra, rb = _both(lambda: member(a, rows[0], 0.0), lambda: member(b, rows[1], 0.1))
    assert not isinstance(ra, Exception) and not isinstance(rb, Exception), (ra, rb)
    assert rows[0].tolist() == rows[1].tolist() == [1.0, 2.0, 3.0, 4.0]
