"""A failed catch-up download is a failed step at this rank, not a crash (issue 28)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from unbroken.comm.catchup import TransferError
from unbroken.train.manager import Manager


def behind_manager(download: Future) -> Manager:
    m = Manager.__new__(Manager)
    m.config = SimpleNamespace(replica_id=2)  # type: ignore[assignment]
    m.stats = {}
    m._fetch = (0.0, download)
    m._refetch = ("127.0.0.1:1", 7)
    m._prepared_for = (5, 7)
    return m


def test_a_download_that_failed_votes_no_and_is_fetched_again_in_the_next_epoch() -> None:
    failed: Future = Future()
    failed.set_exception(TransferError("the transfer from the donor at 127.0.0.1:1 failed: reset"))
    m = behind_manager(failed)
    assert m._fetched() is False
    assert m._fetch is None and m._refetch is None and m._prepared_for is None  # the next decision fetches anew
    assert m.stats["catch_up_failures"] == 1


def test_a_download_that_completed_lets_the_step_commit() -> None:
    done: Future = Future()
    done.set_result(object())
    m = behind_manager(done)
    assert m._fetched() is True and m._fetch is not None
