"""A failed catch-up download is a failed step at this rank, not a crash (issue 28); a download
begun for a decision the job has moved past is fetched again for the step it trains.

The download is a stand-in for ``fetch_state`` (the integration tests fetch from real donors)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.train.parts import SECRET, fake_server
from unbroken.comm.catchup import TransferError
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.train.step.catch_up import CatchUp

DONORS = {"1": "127.0.0.1:1"}


def behind(epoch: int, step: int) -> QuorumDecision:
    """A decision in which replica 2 catches up from replica 1."""
    return QuorumDecision(epoch=epoch, step=step, members=(1, 2), behind=(2,), donors=((2, 1),))


def catch_up(fetch: Any) -> tuple[CatchUp, dict[str, float]]:
    stats: dict[str, float] = {}
    return CatchUp(fake_server(), SECRET, replica_id=2, stats=stats, fetch=fetch), stats


def state_of(step: int) -> dict[str, Any]:
    return {"user": {"w": step}, "unbroken": {"step": step}}


def test_a_download_that_failed_votes_no_and_is_fetched_again_in_the_next_epoch() -> None:
    calls: list[tuple[str, int]] = []

    def fetch(address: str, step: int, secret: Any, into: Any = None) -> Any:
        calls.append((address, step))
        if len(calls) == 1:
            raise TransferError("the transfer from the donor at 127.0.0.1:1 failed: reset")
        return state_of(step)

    c, stats = catch_up(fetch)
    assert c.plan(behind(5, 7), DONORS)
    assert c.fetched() is False
    assert not c.fetching and stats["catch_up_failures"] == 1
    # The next decision fetches anew, even one for the same epoch and step.
    assert c.plan(behind(5, 7), DONORS)
    assert c.fetched() is True
    assert c.finish(behind(5, 7), lambda state: int(state["unbroken"]["step"])) == 7
    assert calls == [("127.0.0.1:1", 7), ("127.0.0.1:1", 7)] and stats["recoveries"] == 1


def test_a_decision_is_planned_once_and_only_for_the_replica_behind() -> None:
    c, _ = catch_up(lambda address, step, secret, into=None: state_of(step))
    assert not c.plan(QuorumDecision(epoch=5, step=7, members=(1, 2)), DONORS)
    assert c.plan(behind(5, 7), DONORS)
    assert not c.plan(behind(5, 7), DONORS)  # a second exchange would pair with the peers' next one


def test_a_stale_download_is_followed_by_one_of_the_step_the_quorum_trains() -> None:
    calls: list[int] = []

    def fetch(address: str, step: int, secret: Any, into: Any = None) -> Any:
        calls.append(step)
        return state_of(step)

    c, _ = catch_up(fetch)
    assert c.plan(behind(5, 7), DONORS)  # its epoch failed before the download was applied
    assert c.plan(behind(6, 9), DONORS)  # the job moved on: queued behind the running download
    loaded: list[dict[str, Any]] = []
    assert c.finish(behind(6, 9), lambda state: loaded.append(state) or int(state["unbroken"]["step"])) == 9
    assert calls == [7, 9] and loaded == [state_of(9)]


def test_a_stale_download_without_a_donor_for_the_step_is_an_error() -> None:
    c, _ = catch_up(lambda address, step, secret, into=None: state_of(step))
    assert c.plan(behind(5, 7), DONORS)
    with pytest.raises(RuntimeError, match="names no donor"):
        c.finish(behind(6, 9), lambda state: 0)
