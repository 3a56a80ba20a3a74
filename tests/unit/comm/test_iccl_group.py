"""The cross-replica group on the ICCL ring (``UNBROKEN_EXCHANGE=iccl``): two members, threads
of this process, on the job's authenticated store; real sockets, real connection failures."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from unbroken.comm.cross_replica import CrossReplicaGroup
from unbroken.comm.iccl import IcclRing
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer

SECRET = JobSecret.generate()


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


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("UNBROKEN_EXCHANGE", "iccl")
    server = StoreServer("127.0.0.1", SECRET)
    gs = (CrossReplicaGroup(SECRET, timeout_s=5.0), CrossReplicaGroup(SECRET, timeout_s=5.0))
    yield gs, server
    for g in gs:
        g.abandon()


def _configure(gs: tuple[CrossReplicaGroup, CrossReplicaGroup], server: StoreServer, epoch: int) -> None:
    for rank, g in enumerate(gs):
        g.configure(server.address, epoch, rank, 2, tag="test", device=torch.device("cpu"))


def test_sums_and_overlapped_buckets_run_on_the_ring_and_each_epoch_gets_a_new_one(groups: Any) -> None:
    gs, server = groups
    _configure(gs, server, 1)
    t = torch.ones(1000), torch.full((1000,), 2.0)
    _both(lambda: gs[0].allreduce_sum(t[0], 10.0), lambda: gs[1].allreduce_sum(t[1], 10.0))
    assert t[0].tolist() == t[1].tolist() == [3.0] * 1000
    first = gs[0]._pg
    assert isinstance(first, IcclRing) and gs[0].overlaps

    def buckets(g: CrossReplicaGroup, base: float) -> list[float]:
        bufs = [torch.full((5000,), base + i) for i in range(3)]
        pending = [g.start_allreduce_sum(b, 10.0) for b in bufs]  # DDP's buckets, all in flight
        g.finish_allreduce_sums(pending, 10.0)
        return [b[0].item() for b in bufs]

    _configure(gs, server, 2)  # a new epoch: the old ring is closed, a new one built
    assert first._closed
    a, b = _both(lambda: buckets(gs[0], 1.0), lambda: buckets(gs[1], 10.0))
    assert a == b == [11.0, 13.0, 15.0]
    assert gs[0]._pg is not first


def test_a_primary_lost_mid_exchange_costs_no_failure(groups: Any) -> None:
    gs, server = groups
    _configure(gs, server, 1)
    warm = torch.ones(10), torch.ones(10)
    _both(lambda: gs[0].allreduce_sum(warm[0], 10.0), lambda: gs[1].allreduce_sum(warm[1], 10.0))
    ring = gs[0]._pg
    assert isinstance(ring, IcclRing)
    t = torch.ones(8_000_000), torch.full((8_000_000,), 2.0)

    def cut() -> None:
        time.sleep(0.01)
        sock = ring._out[0]
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)

    threading.Thread(target=cut).start()
    a, b = _both(lambda: gs[0].allreduce_sum(t[0], 10.0), lambda: gs[1].allreduce_sum(t[1], 10.0))
    assert isinstance(a, float) and isinstance(b, float), (a, b)  # seconds taken: no ExchangeFailed
    assert bool((t[0] == 3.0).all()) and bool((t[1] == 3.0).all())
    assert ring.paths.failovers == 1
