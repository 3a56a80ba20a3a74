"""The lease's etcd store: its URL, and its records against a real etcd server (skipped, saying
why, where Debian's etcd-server or the [etcd] extra is missing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from unbroken.bench.control_plane.lease_filesystems import EtcdServer, missing_tools
from unbroken.control.state.lease import Lease, LeaseKeeper, Watch, claim_next
from unbroken.control.state.lease_etcd import LeaseEtcd, parse_url


def test_the_url_names_host_port_and_the_jobs_own_name() -> None:
    assert parse_url("etcd://10.0.0.5:2379/llama-70b") == ("10.0.0.5", 2379, "llama-70b")
    assert parse_url("etcd://[::1]:2379/j") == ("::1", 2379, "j")
    for bad in ("etcd://host:2379", "etcd://host/j", "etcd://host:99999/j", "http://host:2379/j", "etcd://h:1/a/b"):
        with pytest.raises(ValueError, match="etcd://HOST:PORT/NAME"):
            parse_url(bad)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    why = missing_tools("etcd", fuse=False)
    if why is not None:
        pytest.skip(why)
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_terms_are_claimed_once_renewed_by_their_holder_and_pruned(etcd: EtcdServer) -> None:
    store = LeaseEtcd(etcd.url)
    mine, started = claim_next(store, 1.0)
    assert not store.claim(Lease(term=mine.term, holder="someone else"))  # one claimant wins a term
    keeper = LeaseKeeper(store, mine, started, 0.25)
    watch = Watch().observe(store.newest(), 0.0)
    assert keeper.renew_once()
    seen = store.newest()
    assert seen is not None and seen.seq == 1 and watch.observe(seen, 0.5).since == 0.5  # a renewal is a change
    other = LeaseEtcd(etcd.url)  # another process: it never wrote term 1, it cannot renew it
    with pytest.raises(OSError):
        other.renew(dataclasses.replace(mine, seq=5))
    for _ in range(4):
        claim_next(other, 1.0)
    assert store.terms() == [3, 4, 5]
    assert not keeper.renew_once() and keeper.is_lost  # replaced: steps down


def test_a_dead_etcd_is_an_oserror_to_the_lease(etcd: EtcdServer) -> None:
    store = LeaseEtcd(etcd.url, timeout_s=0.5)
    claim_next(store, 1.0)
    etcd.kill()
    with pytest.raises(OSError, match="etcd"):
        store.terms()
