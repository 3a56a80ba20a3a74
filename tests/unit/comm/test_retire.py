"""The reaper that releases the groups epochs leave behind: its decisions, and its thread with
fake groups (the real groups' release is tested in tests/integration/test_flat_epochs.py)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from unbroken.comm.retire import GroupReaper, Retired, fate


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
    reaper = GroupReaper(linger_s=30, abort_timeout_s=0.2, poll_s=0.01)
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
