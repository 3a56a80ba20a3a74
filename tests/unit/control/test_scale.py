"""The coordinator's cost per step does not grow with the job, and a standby can take over.

Pure pieces (the heartbeat plan, the short answer's expansion, address lists) without
processes; the fast path's answer size and the client's failover against real sockets.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.live_coordinator import live_coordinator, member, next_op
from tests.unit.control.test_client import HELLO, SECRET, FakeCoordinator
from unbroken.config import ConfigError, parse_host_ports
from unbroken.control import protocol
from unbroken.control.client import CoordinatorClient
from unbroken.control.quorum.heartbeat import alive_every, heartbeat_due, plan_heartbeats, silent_after
from unbroken.control.state.state_store import StateDirInUse, StateStore, wait_for_state_dir


def test_the_heartbeat_period_grows_only_past_the_rate_and_the_silences_with_it() -> None:
    small = plan_heartbeats(30, 0.1, 0.5, 2.0, max_rate=5000)
    assert (small.period_s, small.suspect_after_s, small.timeout_s) == (0.1, 0.5, 2.0)
    big = plan_heartbeats(5000, 0.1, 0.5, 2.0, max_rate=5000)
    assert big.period_s == 1.0 and big.suspect_after_s == 5.0 and big.timeout_s == 10.0
    assert 5000 / big.period_s <= 5000  # the coordinator's budget holds
    with pytest.raises(ValueError, match="positive"):
        plan_heartbeats(10, 0.0, 0.5, 2.0, 5000)


def test_a_short_answer_is_completed_from_the_last_full_one_of_its_epoch() -> None:
    full = {
        "op": "quorum",
        "id": 1,
        "decision": {"epoch": 7, "step": 3, "members": [0, 1, 2], "behind": [2], "donors": [[2, 0]]},
        "transfer_addrs": {"0": "a:1"},
        "store": "s:1",
    }
    assert protocol.expand_answer(full, None) is full
    short = protocol.QuorumSame(id=2, same_epoch=7, step=4).to_msg()
    got = protocol.expand_answer(short, full)
    assert got["id"] == 2 and got["store"] == "s:1" and got["transfer_addrs"] == {"0": "a:1"}
    assert got["decision"] == {"epoch": 7, "step": 4, "members": [0, 1, 2], "behind": [], "donors": []}
    with pytest.raises(ValueError, match="never told"):
        protocol.expand_answer({**short, "same_epoch": 8}, full)
    with pytest.raises(ValueError, match="never told"):
        protocol.expand_answer(short, None)


def test_address_lists_parse_and_bad_ones_say_what_to_fix() -> None:
    assert parse_host_ports("10.0.0.1:29510, 10.0.0.2:29511") == [("10.0.0.1", 29510), ("10.0.0.2", 29511)]
    assert parse_host_ports("h:1") == [("h", 1)]
    for bad in ("", "h:1,", "h:1,,h:2", "h:1,h"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_host_ports(bad, "UNBROKEN_COORDINATOR")


def test_fast_path_answers_are_short_whatever_the_membership(tmp_path: Path) -> None:
    # 40 members: the first answer carries them all; the next steps' answers carry only the
    # epoch and the step (before: the whole membership and every member's address, each step).
    async def scenario() -> None:
        async with live_coordinator(
            tmp_path, SECRET, total_replicas=40, heartbeat_timeout_s=60.0, suspect_after_s=30.0
        ) as c:
            links = [await member(c, SECRET, r, transfer_addr=f"10.0.0.{r}:4000") for r in range(40)]
            sizes: list[list[int]] = []
            for step in (5, 6, 7):
                for link in links:
                    link.send({"op": "quorum", "id": step, "step": step})
                answers = [await next_op(link, "quorum") for link in links]
                sizes.append([len(protocol.encode(a, _NoMac())) for a in answers])
                if step == 5:
                    assert all(a["decision"]["member_runs"] == [[0, 39]] for a in answers)
                else:
                    assert all(
                        a == {"op": "quorum", "id": step, "same_epoch": answers[0]["same_epoch"], "step": step}
                        for a in answers
                    )
            assert max(sizes[1] + sizes[2]) < 100 < min(sizes[0])
            for link in links:
                link.close()

    asyncio.run(scenario())


class _NoMac:
    """Measures a line's JSON without a session."""

    def seal_line(self, payload: bytes) -> bytes:
        return payload


def test_the_client_finds_the_coordinator_that_listens_in_its_list() -> None:
    # The first address refuses (a dead active coordinator); the standby at the second answers.
    dead = FakeCoordinator()
    dead_address = dead.address
    dead.close()
    standby = FakeCoordinator()
    client = CoordinatorClient(f"{dead_address},{standby.address}", SECRET, HELLO, reconnect_timeout_s=20)
    try:
        assert standby.accept()["replica"] == 1
        client.wait_connected(10)
        future = client.request_quorum(5)
        standby.answer(standby.next("quorum"))
        assert future.result(timeout=10)["decision"]["step"] == 5
    finally:
        client.close(finished=False)
        standby.close()


def test_a_standby_takes_the_state_directory_the_moment_the_active_one_lets_go(tmp_path: Path) -> None:
    active = StateStore(tmp_path)
    active.reserve_epochs(1200)
    ceiling = active.epoch_ceiling
    got: list[Any] = []
    stop = threading.Event()
    waiter = threading.Thread(target=lambda: got.append(wait_for_state_dir(tmp_path, stop)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # held: the standby waits
    active.close()  # as the kernel does when the active process dies
    waiter.join(5)
    assert got and isinstance(got[0], int)
    standby = StateStore(tmp_path, lock_fd=got[0])
    try:
        assert standby.epoch_floor >= ceiling  # no epoch the active one may have issued comes again
        with pytest.raises(StateDirInUse):
            StateStore(tmp_path)
    finally:
        standby.close()
    stop.set()
    assert wait_for_state_dir(tmp_path / "x", stop) is None  # given up when told to stop


def test_a_heartbeat_is_due_only_after_a_period_without_any_line() -> None:
    assert heartbeat_due(10.0, float("-inf"), 0.5)  # nothing sent yet
    assert not heartbeat_due(10.0, 9.7, 0.5)  # a quorum request 0.3 s ago is the heartbeat
    assert heartbeat_due(10.0, 9.5, 0.5)


def test_a_large_job_hears_alive_often_enough_for_its_ranks_and_no_more() -> None:
    small = plan_heartbeats(8, 0.1, 0.5, 2.0, 2000.0)
    assert silent_after(small.timeout_s) == 1.5 and alive_every(small.timeout_s) == 0.25  # as before
    large = plan_heartbeats(100_000, 0.1, 0.5, 2.0, 2000.0)
    silent = silent_after(large.timeout_s)
    assert silent == large.timeout_s / 2 and alive_every(large.timeout_s) == silent / 6 > 0.25
