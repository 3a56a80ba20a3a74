"""Node agents speak for their ranks (issue 31): real agents, real ranks, one connection per node.

Two agents on this machine, two distinct nodes of two replicas each: the coordinator must serve
every rank through its node's connection (``status``'s ``nodes``), the replicas must end bitwise
identical, and ``kill -9`` of one agent must take its ranks with it (they are its children) and
leave the other node's replicas training to the end, as without the relay.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.harness import Processes, assert_identical, load_finals, wait_for_step
from tests.integration.test_agents import Cluster, alive, relayed, wait_until

pytestmark = pytest.mark.integration
STEPS = 50


def test_agents_relay_their_ranks_and_a_killed_agent_loses_only_its_node(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with Processes(tmp_path) as ps:
        cluster = Cluster(ps, run_dir, replicas=4, min_replicas=2)
        cluster.agent("a", slots=2, steps=STEPS)
        cluster.agent("b", slots=2, steps=STEPS)
        assert [(e["node"], e["replicas"]) for e in cluster.events("agent_joined")] == [("a", [0, 1]), ("b", [2, 3])]
        for node in "ab":
            relay = cluster.agent_events(node, "agent_started")[0]["relay"]
            assert relay.startswith("127.0.0.1:")
        wait_for_step(run_dir, 3, 5, timeout=90)
        # Every rank through its node's one connection: two node connections, two ranks each.
        wait_until("both nodes relayed", lambda: relayed(cluster.port) == {"a": 2, "b": 2}, timeout=10)
        pids = cluster.kill_agent("b")
        wait_until("b's ranks to die with it", lambda: not any(alive(p) for p in pids), timeout=5)
        lost = wait_until("the coordinator to notice", lambda: cluster.events("agent_lost"))
        assert lost[0]["node"] == "b" and lost[0]["replicas"] == [2, 3]
        wait_until("b's node connection gone", lambda: relayed(cluster.port) == {"a": 2}, timeout=10)
        cluster.wait_agents(["a"])
    evicted = {e["replica"] for e in cluster.events("replica_evicted")}
    assert evicted == {2, 3}, evicted  # a's replicas never missed a step for b's loss
    assert cluster.events("quorum")[-1]["members"] == [0, 1]
    assert not cluster.agent_events("a", "relay_failed")
    finals = load_finals(run_dir, [0, 1])
    assert finals[0]["step"] == STEPS
    assert_identical(finals)
