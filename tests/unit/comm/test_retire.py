"""The reaper that releases the groups epochs leave behind: its decisions, and its thread with
fake groups (the real groups' release is tested in tests/integration/test_flat_epochs.py)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from unbroken.comm.retire import NCCL_LIFECYCLE, BoundedLock, GroupReaper, Retired, fate


class FakeWork:
    def __init__(self, done: bool = False) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


class FakeGroup:
    def __init__(self, abort_blocks: threading.Event | None = None) -> None:
        self.aborted = 0
        self._block = abort_blocks

    def abort(self) -> None:
        if self._block is not None:
            self._block.wait()
        self.aborted += 1


def test_fate_waits_for_gloo_operations_and_aborts_nccl_first() -> None:
    running, over = FakeWork(), FakeWork(done=True)
    assert fate(Retired(object(), "gloo", 1, [over], at=0.0), now=1.0, linger_s=10) == "release"
    assert fate(Retired(object(), "gloo", 1, [over, running], at=0.0), now=1.0, linger_s=10) == "wait"
    assert fate(Retired(object(), "gloo", 1, [running], at=0.0), now=10.5, linger_s=10) == "stuck"
    nccl = Retired(object(), "nccl", 1, [running], at=0.0)
    assert fate(nccl, now=1.0, linger_s=10) == "abort"
    nccl.aborted = True
    assert fate(nccl, now=1.0, linger_s=10) == "release"  # an aborted communicator's work is over


def test_a_group_is_released_once_its_operations_end_not_before() -> None:
    reaper = GroupReaper(linger_s=30, poll_s=0.01)
    group, work = FakeGroup(), FakeWork()
    gone = weakref.ref(group)
    reaper.retire(group, "gloo", 3, [work])
    del group
    time.sleep(0.1)
    gc.collect()
    assert gone() is not None and reaper.released == 0 and reaper.pending == 1
    work._done = True
    assert reaper.drain(5)
    gc.collect()
    assert gone() is None and reaper.released == 1 and reaper.stuck == 0
    reaper.close()


def test_nccl_groups_are_aborted_and_a_stuck_abort_holds_only_its_own_thread() -> None:
    reaper = GroupReaper(linger_s=30, abort_timeout_s=1.0, poll_s=0.01)
    ok, blocked, release = FakeGroup(), FakeGroup(threading.Event()), threading.Event()
    blocked._block = release
    reaper.retire(blocked, "nccl", 1)
    reaper.retire(ok, "nccl", 2)
    assert reaper.drain(5)
    assert ok.aborted == 1 and reaper.aborted == 1 and reaper.stuck == 1  # the blocked one is kept
    release.set()
    reaper.close()


def test_a_gloo_operation_that_outlives_the_bound_is_kept_and_counted() -> None:
    reaper = GroupReaper(linger_s=0.05, poll_s=0.01)
    reaper.retire(FakeGroup(), "gloo", 1, [FakeWork()])
    assert reaper.drain(5)
    assert reaper.stuck == 1 and reaper.released == 0 and reaper.pending == 0
    reaper.close()


def test_a_build_holding_the_nccl_lock_keeps_aborts_out_until_it_ends() -> None:
    """The H200 failure (``Failed to CUDA calloc async`` when an abort ran beside a build)."""
    reaper = GroupReaper(linger_s=30, abort_timeout_s=5, poll_s=0.01)
    group = FakeGroup()
    with NCCL_LIFECYCLE.hold(1.0):  # a communicator being built
        reaper.retire(group, "nccl", 1)
        time.sleep(0.2)
        assert group.aborted == 0
    assert reaper.drain(5) and group.aborted == 1
    reaper.close()


def test_a_stuck_holder_of_the_lock_is_waited_out_not_forever() -> None:
    lock, held, let_go = BoundedLock("test"), threading.Event(), threading.Event()

    def stuck() -> None:
        with lock.hold(1.0):
            held.set()
            let_go.wait(5)

    threading.Thread(target=stuck, daemon=True).start()
    assert held.wait(5)
    started = time.monotonic()
    with lock.hold(0.1):
        waited = time.monotonic() - started
    assert 0.1 <= waited < 1.0 and lock.waited_out == 1
    let_go.set()


def test_settle_bounds_how_many_communicators_wait_for_their_abort() -> None:
    reaper = GroupReaper(linger_s=30, abort_timeout_s=5, poll_s=0.01)
    release = threading.Event()
    groups = [FakeGroup(release) for _ in range(3)]
    for epoch, group in enumerate(groups):
        reaper.retire(group, "nccl", epoch)
    reaper.retire(FakeGroup(), "gloo", 9)  # another backend's groups do not count
    assert not reaper.settle("nccl", 1, 0.2)  # the aborts are blocked: three wait
    release.set()
    assert reaper.settle("nccl", 1, 5)
    assert reaper.drain(5) and sum(g.aborted for g in groups) == 3
    reaper.close()


def test_drain_returns_only_after_a_released_groups_destructor_ended() -> None:
    """A process that exits while a group's destructor runs on the reaper's daemon thread ends in
    std::terminate (seen: exit -6 of a member left out of a job's last epoch)."""
    ended = threading.Event()

    class SlowToDestroy(FakeGroup):
        def __del__(self) -> None:
            time.sleep(0.3)
            ended.set()

    reaper = GroupReaper(linger_s=30, poll_s=0.01)
    reaper.retire(SlowToDestroy(), "gloo", 1)
    assert reaper.drain(5)
    assert ended.is_set()
    reaper.close()
