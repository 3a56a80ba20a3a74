"""The lease rules: when a holder may answer, when a standby may take over, who wins a term.

Pure rules with the time passed in; the file shell on a temporary directory (no processes).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from unbroken.control.state.lease import (
    RECORD_BYTES,
    Lease,
    LeaseFiles,
    LeaseKeeper,
    LeaseStoreFailed,
    Watch,
    check_periods,
    claim_next,
    fit_to_store,
    lost,
    mount_of,
    mount_problem,
    next_term,
    store_gives_up_after,
    to_prune,
    valid_until,
    wait_for_takeover,
)
from unbroken.control.state.state_store import lock_state_dir

L, R = 1.0, 0.25


def lease(term: int = 1, seq: int = 0, holder: str = "a") -> Lease:
    return Lease(term=term, holder=holder, seq=seq, lease_s=L)


def test_a_holder_stops_answering_before_any_standby_may_take_over() -> None:
    # The holder's renewal starts at 10.0 and lands at 10.1; the standby sees it at 10.15 at
    # the earliest. The holder's answers end before the standby's count can run out.
    until = valid_until(10.0, L, R)
    standby = Watch().observe(lease(seq=5), 10.15)
    assert until < 10.15 + L
    assert not standby.expired(until, L)
    assert standby.expired(10.15 + L, L)


def test_a_standby_counts_from_the_last_change_it_saw() -> None:
    w = Watch().observe(lease(seq=1), 0.0)
    w = w.observe(lease(seq=1), 0.9)
    assert not w.expired(0.99, L)
    w = w.observe(lease(seq=2), 0.95)  # a renewal restarts the count
    assert not w.expired(1.5, L)
    assert w.expired(1.95, L)


def test_no_lease_file_is_waited_for_like_an_unchanged_one() -> None:
    assert not Watch().expired(100.0, L)  # nothing read yet
    w = Watch().observe(None, 5.0)
    assert not w.expired(5.5, L) and w.expired(6.0, L)


def test_the_holders_longer_lease_is_respected() -> None:
    w = Watch().observe(Lease(term=1, holder="a", lease_s=10.0), 0.0)
    assert not w.expired(5.0, L) and w.expired(10.0, L)


def test_a_claimant_waits_one_more_lease_if_the_old_holder_renewed_meanwhile() -> None:
    w = Watch().observe(lease(seq=3), 0.0)
    assert w.active_at(lease(seq=3), 1.0, L) == 1.0
    assert w.active_at(lease(seq=4), 1.0, L) == 2.0


def test_terms() -> None:
    assert next_term([]) == 1 and next_term([3, 1]) == 4
    assert lost(2, [1, 2, 3]) and not lost(3, [1, 2, 3])
    assert to_prune([1, 2, 3, 4, 5], keep=3) == [1, 2]
    with pytest.raises(ValueError, match="at least twice"):
        check_periods(1.0, 0.6)
    check_periods(1.0, 0.5)


def test_a_malformed_lease_is_refused() -> None:
    assert Lease.from_json(lease(term=3, seq=2).to_json()) == lease(term=3, seq=2)
    for text in (
        "",
        "{}",
        '{"term": 0, "holder": "a", "seq": 0, "lease_s": 1}',
        '{"term": 1, "holder": "a", "seq": 0, "lease_s": 1e9}',
    ):
        with pytest.raises(ValueError):
            Lease.from_json(text)


def test_only_one_claimant_wins_a_term_and_old_terms_are_pruned(tmp_path: Path) -> None:
    files = LeaseFiles(tmp_path)
    assert files.claim(lease(1, holder="a"))
    assert not files.claim(lease(1, holder="b"))
    assert files.read(1) is not None and files.read(1).holder == "a"  # type: ignore[union-attr]
    for t in range(2, 7):
        assert files.claim(lease(t))
    assert files.terms() == [4, 5, 6]
    (tmp_path / "lease-9.json").write_text("torn")
    assert files.read(9) is None and files.newest() is None  # not trusted
    assert not list(tmp_path.glob(".lease-*"))  # no temporary file left


def test_a_keeper_renews_and_steps_down_when_a_higher_term_is_claimed(tmp_path: Path) -> None:
    files = LeaseFiles(tmp_path)
    now = [0.0]
    mine, started = claim_next(files, L, clock=lambda: now[0])
    gone: list[Lease | None] = []
    keeper = LeaseKeeper(files, mine, started, R, on_lost=gone.append, clock=lambda: now[0])
    assert keeper.valid(0.5) and not keeper.valid(0.75)
    now[0] = 0.7
    assert keeper.renew_once() and keeper.valid(1.4) and not keeper.valid(1.45)
    renewed = files.read(mine.term)
    assert renewed is not None and renewed.seq == keeper.lease.seq > 0  # the file's stamp
    assert files.claim(Lease(term=mine.term + 1, holder="b", lease_s=L))
    now[0] = 0.8
    assert not keeper.renew_once()
    assert not keeper.valid(0.9)  # stepped down: never valid again
    assert gone and gone[0] is not None and gone[0].holder == "b"


def test_a_takeover_before_its_active_time_is_not_valid(tmp_path: Path) -> None:
    files = LeaseFiles(tmp_path)
    keeper = LeaseKeeper(files, lease(1), 10.0, R, active_at=10.5)
    assert not keeper.valid(10.2) and keeper.valid(10.6)


def test_a_standby_takes_over_a_lapsed_lease_while_the_lock_is_held(tmp_path: Path) -> None:
    lock = lock_state_dir(tmp_path)  # a hung coordinator keeps its lock
    try:
        files = LeaseFiles(tmp_path)
        assert files.claim(lease(1, holder="hung"))
        stop = threading.Event()
        got = wait_for_takeover(tmp_path, stop, lease_s=0.2, poll_s=0.01)
        assert got is not None and got.lock_fd is None and got.lease.term == 2
        assert files.newest() is not None and files.newest().holder == got.lease.holder  # type: ignore[union-attr]
    finally:
        os.close(lock)
    # With the lock free (the process died) the takeover is at once, with the lock.
    got2 = wait_for_takeover(tmp_path, threading.Event(), lease_s=30.0)
    assert got2 is not None and got2.lock_fd is not None and got2.lease.term == 3
    os.close(got2.lock_fd)
    stop = threading.Event()
    stop.set()
    assert wait_for_takeover(tmp_path, stop, lease_s=30.0) is None


def test_a_store_held_through_the_lease_takes_the_lock_once_it_is_free(tmp_path: Path) -> None:
    from unbroken.control.state.state_store import StateDirInUse, StateStore

    hung = lock_state_dir(tmp_path)
    store = StateStore(tmp_path, fenced=True)
    try:
        assert not store.adopt_lock()  # the hung one still holds it
        os.close(hung)  # its process ended
        assert store.adopt_lock()
        with pytest.raises(StateDirInUse):
            StateStore(tmp_path)  # a plain coordinator on the same directory is refused
    finally:
        store.close()


def test_a_renewal_changes_the_record_whatever_the_timestamps_say(tmp_path: Path) -> None:
    # On a filesystem that keeps whole seconds most renewals leave the timestamp as it was: the
    # standby must see each one all the same. Here every timestamp is set back after each write.
    files = LeaseFiles(tmp_path)
    mine, started = claim_next(files, L)
    keeper = LeaseKeeper(files, mine, started, R)
    watch = Watch().observe(files.newest(), 0.0)
    for i in range(1, 6):
        assert keeper.renew_once()
        os.utime(files.path(mine.term), ns=(10**18, 10**18))
        seen = files.newest()
        assert seen is not None and seen.seq == i
        watch = watch.observe(seen, 0.9 * i)
        assert watch.since == 0.9 * i  # counted as a renewal
    assert not watch.expired(0.9 * 5 + 0.99, L)
    assert os.path.getsize(files.path(mine.term)) == RECORD_BYTES  # rewritten in place, never grown


class FailingStore:
    """A lease store whose calls fail (EIO) while ``failing`` is set: a stand-in for a store's
    failure in a test of the keeper's rules alone (the real one is in tests/integration)."""

    def __init__(self, inner: LeaseFiles) -> None:
        self.inner, self.where, self.failing = inner, inner.where, False

    def _check(self) -> None:
        if self.failing:
            raise OSError(errno.EIO, "Input/output error")

    def terms(self) -> list[int]:
        self._check()
        return self.inner.terms()

    def read(self, term: int) -> Lease | None:
        self._check()
        return self.inner.read(term)

    def newest(self) -> Lease | None:
        self._check()
        return self.inner.newest()

    def claim(self, lease: Lease) -> bool:
        self._check()
        return self.inner.claim(lease)

    def renew(self, lease: Lease) -> None:
        self._check()
        self.inner.renew(lease)


def test_a_keeper_retries_a_failing_store_and_gives_up_past_the_bound(tmp_path: Path) -> None:
    store = FailingStore(LeaseFiles(tmp_path))
    now = [0.0]
    mine, started = claim_next(store, L, clock=lambda: now[0])
    keeper = LeaseKeeper(store, mine, started, R, clock=lambda: now[0])
    store.failing = True
    for t in (0.25, 0.5, 0.75):
        now[0] = t
        assert keeper.renew_once()  # retried, the thread goes on
    assert keeper.renew_failures == 3 and not keeper.valid(0.75) and not keeper.gave_up(1.2)
    store.failing = False
    now[0] = 1.0
    assert keeper.renew_once() and keeper.valid(1.1) and not keeper.gave_up(2.0)  # back within the bound
    assert not keeper.gave_up(1.0 + store_gives_up_after(L, R))  # a stopped process woken is no failure
    store.failing = True
    now[0] = 1.25
    assert keeper.renew_once()
    assert keeper.gave_up(1.0 + store_gives_up_after(L, R))
    assert store_gives_up_after(L, R) + R <= 2 * L  # the watchdog exits within two lease periods


def test_a_standby_never_takes_over_on_a_failing_store_and_gives_up_past_the_bound(tmp_path: Path) -> None:
    store = FailingStore(LeaseFiles(tmp_path))
    lock = lock_state_dir(tmp_path)  # the active coordinator holds the lock
    try:
        assert store.claim(lease(1, holder="active"))
        store.failing = True
        with pytest.raises(LeaseStoreFailed, match="failed for"):
            wait_for_takeover(tmp_path, threading.Event(), lease_s=0.2, poll_s=0.01, files=store, gives_up_s=0.3)
        assert store.inner.terms() == [1]  # no claim: not knowing is no reason to take over
    finally:
        os.close(lock)


def test_a_slow_store_widens_the_lease_and_says_why() -> None:
    assert fit_to_store(1.0, 0.25, 0.01) == (1.0, 0.25, None)
    lease_s, renew_s, why = fit_to_store(1.0, 0.25, 0.2)
    assert renew_s >= 0.8 and lease_s >= 4 * renew_s and why is not None and "200 ms" in why
    with pytest.raises(ValueError, match="faster filesystem"):
        fit_to_store(1.0, 0.25, 200.0)


def test_nfs_without_close_to_open_is_refused_and_its_mount_is_found(tmp_path: Path) -> None:
    assert mount_problem("ext4", {"rw", "relatime"}) is None
    assert mount_problem("nfs4", {"rw", "actimeo=60"}) is None  # open revalidates (close-to-open)
    problem = mount_problem("nfs4", {"rw", "nocto"})
    assert problem is not None and "nocto" in problem and "etcd" in problem
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        f"40 22 0:40 / {tmp_path} rw,nosuid shared:9 - nfs4 server:/x rw,nocto,vers=4.2\n"
    )
    assert mount_of(tmp_path / "state", str(info)) == ("nfs4", {"rw", "nosuid", "nocto", "vers=4.2"})
    assert mount_of("/elsewhere", str(info)) == ("ext4", {"rw", "relatime"})


def test_the_probe_measures_the_store(tmp_path: Path) -> None:
    probe = LeaseFiles(tmp_path).probe()
    assert 1 <= probe.timestamp_ns <= 2_000_000_000 and 0 < probe.latency_s < 5.0
    assert list(tmp_path.iterdir()) == []  # its file removed
