"""A replica's own rendezvous store: authenticated, bound to MASTER_ADDR, in any start order."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from unbroken.comm.store_client import StoreError
from unbroken.config import ENV_MASTER_ADDR, ENV_MASTER_PORT, ReplicaConfig
from unbroken.train.replica_group import replica_store
from unbroken.wire.auth import JobSecret


def _config(rank: int) -> ReplicaConfig:
    return ReplicaConfig(coordinator="127.0.0.1:1", replica_id=0, num_replicas=1, rank=rank, world_size=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ranks_meet_in_any_order_and_a_keyless_client_cannot_write() -> None:
    secret = JobSecret.generate()
    env = {ENV_MASTER_ADDR: "127.0.0.1", ENV_MASTER_PORT: str(_free_port())}
    found: dict[str, object] = {}

    def rank1() -> None:  # starts before rank 0 listens
        try:
            found["store"] = replica_store(_config(1), secret, timeout_s=10, env=env)[0]
        except Exception as e:  # handed to the assertion
            found["store"] = e

    t = threading.Thread(target=rank1)
    t.start()
    store0, server = replica_store(_config(0), secret, timeout_s=10, env=env)
    t.join(15)
    store1 = found["store"]
    assert server is not None and not isinstance(store1, Exception)
    try:
        store0.set("k", b"v")
        assert store1.get("k") == b"v"  # type: ignore[union-attr]
        assert server.host == "127.0.0.1"  # MASTER_ADDR only, not every interface
        # What torch's own TCPStore would have allowed anyone on the machine: a write.
        with pytest.raises(Exception):
            client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=2))
            client.set("k", b"attacker")
        assert store1.get("k") == b"v"  # type: ignore[union-attr]
        with pytest.raises(StoreError):
            replica_store(_config(1), JobSecret.generate(), timeout_s=0.5, env=env)
    finally:
        server.close()
