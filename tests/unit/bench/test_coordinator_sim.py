"""The simulated groups' schedule in ``unbroken bench coordinator`` (no sockets, no processes).

A real replica cannot start a step before its exchange of the last one ends, and the exchange
holds every member back: an answer that comes after the next step was due (a standby taking
over) moves every group's schedule, not one group's, and a newcomer waiting to be admitted holds
nobody back. Without that, the groups asked for the steps their clocks said once the answers came
back, a mixture of steps no job trains, and the bench measured the evictions it caused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import time
from typing import Any

import pytest

from unbroken.bench.control_plane.coordinator_sim import Plan, SimReplica
from unbroken.control import protocol
from unbroken.control.protocol.serving import ConnectionServer
from unbroken.wire.auth import JobSecret


def plan(t0: float) -> Plan:
    return Plan(
        addresses=(("127.0.0.1", 1),),
        key=b"k" * 32,
        replicas=(0, 1),
        t0=t0,
        steps=20,
        step_time=1.0,
        jitter=0.0,
        heartbeat_s=1.0,
        victim=1,
        disconnect_step=2,
        rejoin_step=4,
    )


def test_an_answer_after_the_next_step_was_due_moves_every_groups_schedule() -> None:
    held = multiprocessing.Value("d", 0.0)
    answered = multiprocessing.Value("q", -1)
    p = plan(time.monotonic() - 10.0)  # step 6 was due 4 s ago
    group, other = SimReplica(p, 0, 0.0, answered, held), SimReplica(p, 2, 0.0, answered, held)
    group._held_back(12)  # step 12's answer, with step 13 due in 3 s: on time, nothing moves
    assert held.value == 0.0
    group._held_back(5)  # step 6 was due 4 s ago
    assert held.value == pytest.approx(4.0, abs=0.2)
    assert other._start(6) == pytest.approx(time.monotonic(), abs=0.2)  # every group starts step 6 now
    group._held_back(5)  # the same wait, told again: counted once
    other._held_back(5)
    assert held.value == pytest.approx(4.0, abs=0.2)


def test_a_newcomers_wait_holds_nobody_back() -> None:
    held = multiprocessing.Value("d", 0.0)
    p = plan(time.monotonic() - 10.0)
    SimReplica(p, 1, 0.0, multiprocessing.Value("q", -1), held)._held_back(5)  # the victim, rejoining
    assert held.value == 0.0


def test_a_group_says_what_it_asked_before_a_loss_right_behind_its_hello() -> None:
    # As a replica's client (control.client) and a relay do: not after the welcome, which would
    # make every node of a takeover cost the standby a round trip more than a real job's.
    async def scenario() -> list[str]:
        said: list[str] = []

        def dispatch(msg: dict[str, Any], link: Any, c: Any, a: Any) -> tuple[str, Any, Any]:
            said.append(msg["op"])  # and no welcome
            return msg["op"], c, a

        server: ConnectionServer[Any, Any] = ConnectionServer(
            JobSecret(b"k" * 32), 4, 10.0, dispatch=dispatch, closed=lambda c, a: None
        )
        listener = await asyncio.start_server(server.serve, "127.0.0.1", 0, limit=protocol.MAX_LINE)
        port = listener.sockets[0].getsockname()[1]
        p = dataclasses.replace(plan(time.monotonic()), addresses=(("127.0.0.1", port),))
        group = SimReplica(p, 0, 0.0, multiprocessing.Value("q", -1))
        group._pending[7] = (5, time.monotonic(), False, asyncio.get_running_loop().create_future())
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await group.connect(time.monotonic() + 0.5)
        group.closed = True
        listener.close()
        return said

    assert asyncio.run(scenario()) == ["hello", "quorum"]


@pytest.mark.parametrize("epoch", [None, 5])
def test_a_simulated_node_says_the_node_hello_a_relay_says(epoch: int | None) -> None:
    """Built without its eight Hello objects, the simulated node's hello is the protocol's own text."""
    from unbroken.bench.control_plane.coordinator_sim_nodes import SimNode

    node = SimNode(dataclasses.replace(plan(0.0), ranks_per_node=8), 6001, 0.0, multiprocessing.Value("q", -1))
    node.step, node.epoch = 33, epoch
    ranks = tuple(
        protocol.Hello(
            replica=6001,
            rank=k,
            world_size=8,
            transfer_addr=f"127.0.0.1:{20000 + (6001 * 8 + k) % 40000}",
            node="sim6001",
            step=33,
            epoch=epoch,
        )
        for k in range(8)
    )
    said = node._hello_msg()
    assert json.dumps(said) == json.dumps(protocol.NodeHello(node="sim6001", ranks=ranks).to_msg())  # the same text
    assert protocol.NodeHello.from_msg(said).ranks == ranks  # and the coordinator reads it as such
