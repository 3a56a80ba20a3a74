"""Each UNBROKEN_EXCHANGE value is its own transport class, picked by one factory."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from unbroken.comm.cross_replica import CrossReplicaGroup
from unbroken.comm.transport import BackendTransport, IcclTransport, RingTransport, make_transport
from unbroken.config import EXCHANGES
from unbroken.wire.auth import JobSecret


def test_every_exchange_setting_has_its_transport() -> None:
    kinds = {mode: type(make_transport(mode)) for mode in EXCHANGES}
    assert kinds == {"backend": BackendTransport, "ring": RingTransport, "iccl": IcclTransport}
    assert all(make_transport(mode).name == mode for mode in EXCHANGES)
    with pytest.raises(ValueError, match="exchange must be one of"):
        make_transport("nccl")


def test_only_the_ring_refuses_overlapped_sums_and_other_ops() -> None:
    assert make_transport("backend").overlaps and make_transport("iccl").overlaps
    assert not make_transport("ring").overlaps
    with pytest.raises(ValueError, match="only sums"):
        make_transport("ring").start(None, torch.ones(1), 0, 2, threading.Event(), dist.ReduceOp.MAX, None)


def test_the_group_takes_the_transport_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNBROKEN_EXCHANGE", "ring")
    assert isinstance(CrossReplicaGroup(JobSecret.generate()).transport, RingTransport)
    given = IcclTransport()
    assert CrossReplicaGroup(JobSecret.generate(), transport=given).transport is given
