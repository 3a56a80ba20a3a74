"""The job's store: only key holders use it, it listens where the coordinator does, and Gloo
rendezvous through it."""

from __future__ import annotations

import asyncio
import datetime
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from unbroken.comm.store_client import AuthenticatedStore, StoreError
from unbroken.config import local_address_towards
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.wire import store as store_module
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer

SECRET = JobSecret.generate()


@pytest.fixture
def server() -> StoreServer:
    s = StoreServer("127.0.0.1", SECRET)
    yield s
    s.close()


def test_the_operations_gloo_and_torch_build_on(server: StoreServer) -> None:
    s = AuthenticatedStore(server.address, SECRET, timeout=datetime.timedelta(seconds=0.3))
    s.set("a", b"1")
    assert s.get("a") == b"1" and s.check(["a"]) and not s.check(["a", "b"])
    assert s.add("n", 3) == 3 and s.add("n", -1) == 2 and s.get("n") == b"2"
    assert s.compare_set("c", b"", b"x") == b"x"  # absent and expected empty: set
    assert s.compare_set("c", b"y", b"z") == b"x"  # mismatch: the current value, unchanged
    assert s.compare_set("c", b"x", b"z") == b"z"
    assert s.num_keys() == 3 and s.delete_key("c") and not s.delete_key("c")
    prefix = dist.PrefixStore("p", s)  # torch's own helpers on top of the Python store
    prefix.append("l", b"1")
    prefix.append("l", b"2")
    assert prefix.multi_get(["l"]) == [b"12"]
    with pytest.raises(StoreError, match="did not appear"):
        s.get("never")
    with pytest.raises(StoreError, match="did not all appear"):
        s.wait(["never"], datetime.timedelta(seconds=0.2))
    s.close()


def test_a_waiting_get_does_not_hold_up_other_calls(server: StoreServer) -> None:
    """An abandoned epoch's rendezvous may still wait while the next epoch's group is built."""
    s = AuthenticatedStore(server.address, SECRET, timeout=datetime.timedelta(seconds=10))
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(s.get("late")))
    waiter.start()
    s.set("other", b"1")
    assert s.get("other") == b"1"  # answered while the other thread's get still waits
    s.set("late", b"2")
    waiter.join(10)
    assert got == [b"2"]


def test_bounds_on_keys_and_values_are_enforced(server: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    s = AuthenticatedStore(server.address, SECRET)
    with pytest.raises(StoreError, match="store key"):
        s.set("k" * (store_module.MAX_KEY + 1), b"")
    with pytest.raises(StoreError, match="store value"):
        s.set("k", b"v" * (store_module.MAX_VALUE + 1))
    monkeypatch.setattr(store_module, "MAX_KEYS", 3)
    for i in range(5):
        s.set(f"epoch{i}", b"x")
    assert s.num_keys() == 3 and not s.check(["epoch0"]) and s.check(["epoch4"])  # the oldest go


def test_nobody_without_the_key_reads_or_writes_the_store(server: StoreServer) -> None:
    AuthenticatedStore(server.address, SECRET).set("unbroken/rank0/epoch1/0", b"addr")
    with pytest.raises(StoreError, match="failed authentication"):
        AuthenticatedStore(server.address, JobSecret.generate()).get("unbroken/rank0/epoch1/0")
    assert server.refused == 1


def test_gloo_rendezvous_through_the_store_and_binds_loopback(server: StoreServer) -> None:
    results: dict[int, object] = {}

    def member(rank: int) -> None:
        try:
            from unbroken.comm.cross_replica import CrossReplicaGroup

            group = CrossReplicaGroup(SECRET, timeout_s=10.0)
            group.configure(server.address, 1, rank, 2, tag="t", device=torch.device("cpu"))
            t = torch.full((3,), float(rank + 1))
            group.allreduce_sum(t, deadline_s=10.0)
            results[rank] = t.tolist()
        except Exception as e:  # handed to the assertion
            results[rank] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: [3.0] * 3, 1: [3.0] * 3}


async def _coordinator_store(state_dir: Path) -> tuple[str, str | None, str | None]:
    c = Coordinator(CoordinatorSettings(total_replicas=1, state_dir=state_dir), SECRET)
    await c.start()
    try:
        host, port = c.store_address.rsplit(":", 1)
        # What anyone on this machine could do on main: a TCPStore client writing the job's keys.
        anonymous = None
        try:
            client = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=2))
            client.set("unbroken/rank0/epoch1/0", b"attacker")
            anonymous = "wrote a key"
        except Exception:  # noqa: BLE001 - the authenticated store does not speak to it
            anonymous = None
        # And from another machine: the store must not listen beyond the coordinator's host.
        outside = local_address_towards("192.0.2.1")
        reached = None
        if outside != "127.0.0.1":
            try:
                socket.create_connection((outside, int(port)), timeout=2).close()
                reached = outside
            except OSError:
                reached = None
        return c.store_address, anonymous, reached
    finally:
        await c.stop()


def test_the_coordinators_store_authenticates_and_listens_on_its_host_only(tmp_path: Path) -> None:
    address, anonymous, reached = asyncio.run(_coordinator_store(tmp_path))
    assert address.startswith("127.0.0.1:")
    assert anonymous is None, "an unauthenticated client used the job's store"
    assert reached is None, f"the store of a loopback coordinator is reachable at {reached}"


def test_a_member_keeps_connections_to_the_last_few_stores_it_met_on_only() -> None:
    """Each epoch's groups may meet on another node's store (the leader turns with the epoch): a
    member of a long job keeps pooled connections to the MAX_STORES it used last, and closes the
    rest, on its side and so on the store's."""
    from unbroken.comm.cross_replica import MAX_STORES, CrossReplicaGroup

    servers = [StoreServer("127.0.0.1", SECRET) for _ in range(MAX_STORES + 2)]
    group = CrossReplicaGroup(SECRET)
    try:
        for n, server in enumerate(servers):
            group._store(server.address).set(f"epoch{n}", b"x")
        again = group._store(servers[2].address)  # met on again: kept, the newest now
        assert again.get("epoch2") == b"x"
        assert list(group._stores) == [s.address for s in servers[3:]] + [servers[2].address]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(len(s._conns) for s in servers[:2]):
            time.sleep(0.01)
        assert [len(s._conns) for s in servers] == [0, 0] + [1] * MAX_STORES
    finally:
        for server in servers:
            server.close()
