"""A live coordinator trusts no connection further than it must (issue 16).

Each scenario is what the audit did with small scripts on loopback: without the key nothing is
read, and with it a member still speaks only for itself, within the job's ranges.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.live_coordinator import closed, connect, live_coordinator, member, next_op
from unbroken.control import protocol
from unbroken.control.client import listed_decision
from unbroken.control.coordinator import JOIN_WINDOW_MAX_S, Coordinator
from unbroken.wire.auth import AuthError, JobSecret, client_handshake

SECRET = JobSecret.generate()


def run(state_dir: Path, scenario: Callable[[Coordinator], Awaitable[None]], **settings: Any) -> None:
    settings = {"heartbeat_timeout_s": 60.0, "suspect_after_s": 30.0, **settings}  # test clients send no heartbeats

    async def main() -> None:
        async with live_coordinator(state_dir, SECRET, **settings) as c:
            await asyncio.wait_for(scenario(c), 20)

    asyncio.run(main())


LAST: dict[int, dict[str, Any]] = {}  # each link's last full answer, as the client keeps it


async def quorum(link: protocol.Link, step: int, req_id: int = 1, **extra: Any) -> dict[str, Any]:
    link.send({"op": "quorum", "id": req_id, "step": step, **extra})
    answer = protocol.expand_answer(await next_op(link, "quorum"), LAST.get(id(link)))
    answer = {**answer, "decision": listed_decision(answer["decision"])}  # as the client decodes it
    LAST[id(link)] = answer
    return dict(answer["decision"])


async def two_members(c: Coordinator) -> tuple[protocol.Link, protocol.Link, dict[str, Any]]:
    """Replicas 0 and 1 of a 3-replica job (min 2) in a first epoch at step 5."""
    a, b = await member(c, SECRET, 0), await member(c, SECRET, 1)
    c.quorum.rules = type(c.quorum.rules)(total_replicas=3, min_replicas=2, startup_window_s=0.0)
    d = await asyncio.gather(quorum(a, 5), quorum(b, 5))
    return a, b, d[0]


def test_a_client_without_the_key_is_dropped_and_changes_nothing(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        host, port = c.address.rsplit(":", 1)
        # A plain JSON hello, as every client sent before.
        _, w = await asyncio.open_connection(host, int(port))
        w.write(json.dumps({"op": "hello", "replica": 0, "rank": 0, "world_size": 1}).encode() + b"\n")
        w.write(json.dumps({"op": "exited", "replica": 0}).encode() + b"\n")
        await w.drain()
        # A client with another job's key.
        with pytest.raises(ConnectionError):
            await asyncio.to_thread(protocol.connect, host, int(port), JobSecret.generate(), 5.0)
        for _ in range(100):
            if c.auth_failures >= 2:
                break
            await asyncio.sleep(0.02)
        assert c.auth_failures == 2 and c.replicas == {} and c.quorum.alive == set()
        w.close()

    run(tmp_path, scenario)


def test_a_line_without_a_valid_mac_ends_the_connection(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        link = await connect(c, SECRET)
        link.writer.write(json.dumps({"op": "hello", "replica": 0, "rank": 0, "world_size": 1}).encode() + b"\n")
        assert await closed(link)
        assert c.replicas == {} and c.auth_failures == 1

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    "hello",
    [
        {"replica": 3, "rank": 0, "world_size": 1},  # the job has replicas 0..2
        {"replica": 0, "rank": 1, "world_size": 1},
        {"replica": 0, "rank": 0, "world_size": 0},
        {"replica": -1, "rank": 0, "world_size": 1},
        {"replica": 0, "rank": 0, "world_size": 1, "node": "x" * 10_000},
    ],
)
def test_a_hello_out_of_the_jobs_ranges_is_refused(tmp_path: Path, hello: dict[str, Any]) -> None:
    async def scenario(c: Coordinator) -> None:
        link = await connect(c, SECRET)
        link.send({"op": "hello", **hello})
        assert await closed(link)
        assert c.replicas == {} and c.quorum.alive == set()

    run(tmp_path, scenario)


def test_a_live_rank_cannot_be_taken_over(tmp_path: Path) -> None:
    # Refused while the old connection lives; served once it is gone.
    async def scenario(c: Coordinator) -> None:
        a, b, first = await two_members(c)
        thief = await connect(c, SECRET)
        thief.send({"op": "hello", "replica": 0, "rank": 0, "world_size": 1, "transfer_addr": "10.6.6.6:1"})
        error = await next_op(thief, "error")
        assert "already connected" in error["message"] and await closed(thief)
        assert (await quorum(a, 6, 2))["epoch"] == first["epoch"]  # the real replica 0 is still served
        assert c.replicas[0][0].transfer_addr == ""
        a.close()
        for _ in range(100):
            if 0 not in c.replicas:
                break
            await asyncio.sleep(0.02)
        again = await member(c, SECRET, 0)  # its restart is welcome
        again.close()
        b.close()

    run(tmp_path, scenario)


def test_a_connection_speaks_only_for_its_own_replica(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a, b, _ = await two_members(c)
        a.send({"op": "exited", "replica": 1, "exitcode": 9})  # evict another replica
        assert "only its own exit" in (await next_op(a, "error"))["message"]
        a.send({"op": "hello", "replica": 2, "rank": 0, "world_size": 1})  # a second identity
        assert "said hello already" in (await next_op(a, "error"))["message"]
        anonymous = await connect(c, SECRET)
        anonymous.send({"op": "exited", "replica": 1})
        anonymous.send({"op": "telemetry", "now_ns": 0, "records": []})
        assert (await next_op(anonymous, "error"))["message"] == "say hello first"
        agent = await connect(c, SECRET)
        agent.send({"op": "agent_hello", "node": "n9", "slots": 1})
        mine = (await next_op(agent, "assign"))["replicas"]
        other = next(r for r in (0, 1) if r not in mine)
        agent.send({"op": "exited", "replica": other})  # not the agent's replica
        assert "does not run on node n9" in (await next_op(agent, "error"))["message"]
        await asyncio.sleep(0.1)
        assert {0, 1} <= c.quorum.alive and 1 in c.replicas
        for link in (anonymous, agent, b):
            link.close()

    run(tmp_path, scenario)


def test_step_times_cannot_stretch_the_join_window(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a, b, _ = await two_members(c)
        a.send({"op": "quorum", "id": 2, "step": 6, "step_time": 1e308})
        assert "seconds" in (await next_op(a, "error"))["message"]
        for step in range(6, 12):  # a day per step, as long as a step may say it took
            await asyncio.gather(
                quorum(a, step, step + 10, step_time=86400.0), quorum(b, step, step + 10, step_time=86400.0)
            )
        await asyncio.sleep(2 * c.TICK_S)
        assert c.settings.join_window_floor_s <= c.quorum.join_window_s <= JOIN_WINDOW_MAX_S

    run(tmp_path, scenario)


def test_a_member_cannot_go_back_below_its_epochs_step(tmp_path: Path) -> None:
    # Before, a member asking for an old step re-formed every member's epoch, step after step.
    async def scenario(c: Coordinator) -> None:
        a, b, first = await two_members(c)
        a.send({"op": "quorum", "id": 2, "step": 0})
        assert await closed(a)  # treated as the failure it is: evicted, it rejoins and catches up
        assert 0 not in c.quorum.alive and 1 in c.quorum.alive
        # Its restarted process is a newcomer, though replica 0 is still in the broken epoch's
        # members: it asks for the step of its checkpoint and is answered, not evicted again.
        restarted = await member(c, SECRET, 0)
        restarted.send({"op": "quorum", "id": 1, "step": 0})
        b.send({"op": "quorum", "id": 2, "step": 5, "failed_epoch": first["epoch"]})
        decision = listed_decision((await next_op(restarted, "quorum"))["decision"])
        assert decision["members"] == [0, 1] and decision["behind"] == [0] and decision["step"] == 5
        link = await connect(c, SECRET)
        link.send({"op": "hello", "replica": 2, "rank": 0, "world_size": 1, "step": 0})
        await next_op(link, "welcome")
        link.send({"op": "quorum", "id": 1, "step": -1})  # a negative step
        assert "integer >= 0" in (await next_op(link, "error"))["message"]
        for x in (b, link, restarted):
            x.close()

    run(tmp_path, scenario)


def test_a_failure_report_aborts_only_what_a_real_failure_would(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a, b, first = await two_members(c)
        newcomer = await member(c, SECRET, 2)
        # Not a member of the epoch: its "failure" of the members' exchange is not one.
        newcomer.send({"op": "quorum", "id": 1, "step": 0, "failed_epoch": first["epoch"]})
        await asyncio.sleep(0.2)
        assert not c.quorum.broken
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await next_op(a, "abort", timeout=0.3)
        a.send({"op": "quorum", "id": 2, "step": 5, "failed_epoch": first["epoch"] + 5})  # never formed
        assert "never formed" in (await next_op(a, "error"))["message"]
        # A member's real report breaks its epoch, as before: the other member is told to abort.
        a.send({"op": "quorum", "id": 3, "step": 5, "failed_epoch": first["epoch"]})
        assert (await next_op(b, "abort"))["epoch"] == first["epoch"]
        for x in (a, b, newcomer):
            x.close()

    run(tmp_path, scenario)


def test_a_replica_that_said_bye_asks_for_nothing(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        a, b, _ = await two_members(c)
        a.send({"op": "bye"})
        a.send({"op": "quorum", "id": 2, "step": 6})
        assert "said bye" in (await next_op(a, "error"))["message"]
        assert 0 not in c.pending
        a.close()
        b.close()

    run(tmp_path, scenario)


def test_connections_are_bounded_and_a_silent_one_is_closed(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        host, port = c.address.rsplit(":", 1)
        quiet = [await connect(c, SECRET) for _ in range(3)]  # authenticated, never say hello
        with pytest.raises(AuthError):  # a key holder over the limit is closed at once
            await asyncio.wait_for(connect(c, SECRET), 5)
        assert all([await closed(q, timeout=5) for q in quiet]), "a connection without hello stays open"
        link = await member(c, SECRET, 0)  # room again
        link.close()

    run(tmp_path, scenario, max_connections=3, hello_timeout_s=0.5)


def test_a_status_client_with_the_key_is_answered(tmp_path: Path) -> None:
    async def scenario(c: Coordinator) -> None:
        host, port = c.address.rsplit(":", 1)
        status = await asyncio.to_thread(protocol.request, host, int(port), SECRET, {"op": "status"}, 5.0)
        assert status["op"] == "status" and status["auth_failures"] == 0

    run(tmp_path, scenario)


def test_the_handshake_is_bound_to_the_coordinator(tmp_path: Path) -> None:
    # A handshake made for another listener (a transfer server's) does not open this one.
    async def scenario(c: Coordinator) -> None:
        host, port = c.address.rsplit(":", 1)

        def other_purpose() -> None:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                client_handshake(s, SECRET, "transfer")

        with pytest.raises(ConnectionError):
            await asyncio.to_thread(other_purpose)

    run(tmp_path, scenario)


def test_a_connection_closed_before_a_byte_is_no_refusal_and_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # `make demo` printed "dropped connections to the coordinator: 0 bytes read on a total of 38
    # expected bytes" when it killed its own replica while that replica connected.
    async def scenario(c: Coordinator) -> None:
        host, port = c.address.rsplit(":", 1)
        for _ in range(3):
            _, w = await asyncio.open_connection(host, int(port))
            w.close()
        for _ in range(100):
            if c.connections.vanished >= 3:
                break
            await asyncio.sleep(0.02)
        assert c.connections.vanished == 3 and c.auth_failures == 0
        # a stranger that does say something is still refused, and counted
        _, w = await asyncio.open_connection(host, int(port))
        w.write(b"GET / HTTP/1.0\r\n\r\n" * 3)
        await w.drain()
        for _ in range(300):
            if c.auth_failures >= 1:
                break
            await asyncio.sleep(0.02)
        assert c.auth_failures == 1
        w.close()

    with caplog.at_level(logging.WARNING):
        run(tmp_path, scenario)
    assert [r.message for r in caplog.records if "0 bytes read" in r.message] == []
