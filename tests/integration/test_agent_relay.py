"""Node agents speak for their ranks (issue 31): real agents, real ranks, one connection per node.

Two agents on this machine, two distinct nodes of two replicas each, and a spare: the coordinator
must serve every rank through its node's connection (``status``'s ``nodes``), and, told to spend
few requests a second (``--max-asks-per-s``), let the relays answer granted steps themselves
(``status``'s ``granted``). ``kill -9`` of one agent must take its ranks with it (they are its
children) and leave the other node's replicas training, as without the relay; its replicas,
moved to the spare, are admitted once the granted steps are out, and every replica ends
bitwise identical. Each agent hosts a rendezvous store, and the groups meet on their leader's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.harness import Processes, assert_identical, job_secret, load_finals, wait_for_step
from tests.integration.test_agents import Cluster, alive, relayed, wait_until
from unbroken.control import protocol

pytestmark = pytest.mark.integration
STEPS = 120  # a moved replica (seconds to import torch on a busy machine) still finds steps to catch up to


def granted(port: int) -> int:
    """Fast answers the coordinator at ``port`` granted for more than their step (its ``status``)."""
    try:
        return int(protocol.request("127.0.0.1", port, job_secret(), protocol.StatusRequest().to_msg())["granted"])
    except OSError:
        return 0


def test_agents_relay_their_ranks_answer_granted_steps_and_a_killed_agent_loses_only_its_node(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with Processes(tmp_path) as ps:
        # 4 replicas of ~0.13 s steps ask ~30 times a second: at 5, fast answers stand ~7 steps.
        cluster = Cluster(ps, run_dir, replicas=4, min_replicas=2, coordinator_args=("--max-asks-per-s", "5"))
        cluster.agent("a", slots=2, steps=STEPS)
        cluster.agent("b", slots=2, steps=STEPS)
        cluster.agent("c", slots=2, steps=STEPS)  # a spare node
        joined = [(e["node"], e["replicas"]) for e in cluster.events("agent_joined")]
        assert joined == [("a", [0, 1]), ("b", [2, 3]), ("c", [])]
        for node in "ab":
            relay = cluster.agent_events(node, "agent_started")[0]["relay"]
            assert relay.startswith("127.0.0.1:")
        wait_for_step(run_dir, 3, 5, timeout=90)
        # Every rank through its node's one connection: two node connections, two ranks each.
        wait_until("both nodes relayed", lambda: relayed(cluster.port) == {"a": 2, "b": 2}, timeout=10)
        wait_until("steps granted to the relays", lambda: granted(cluster.port) > 0, timeout=30)
        pids = cluster.kill_agent("b")
        wait_until("b's ranks to die with it", lambda: not any(alive(p) for p in pids), timeout=5)
        lost = wait_until("the coordinator to notice", lambda: cluster.events("agent_lost"))
        assert lost[0]["node"] == "b" and lost[0]["replicas"] == [2, 3]
        moved = wait_until("b's replicas to move", lambda: len(cluster.events("replica_reassigned")) == 2, timeout=10)
        assert moved
        cluster.wait_agents(["a", "c"])
    assert {e["replica"] for e in cluster.events("replica_evicted")} == {2, 3}  # a's never missed a step
    quorums = cluster.events("quorum")
    assert quorums[-1]["members"] == [0, 1, 2, 3], "the moved replicas were never admitted"
    assert not cluster.agent_events("a", "relay_failed")
    # The cross-replica groups met on their leader's node (each agent hosts a store), not on the
    # coordinator's: the stores of the agents that stopped answered their rendezvous.
    assert all(cluster.agent_events(n, "agent_started")[0]["store"].startswith("127.0.0.1:") for n in "abc")
    assert sum(cluster.agent_events(n, "agent_stopped")[0]["store_requests"] for n in "ac") > 0
    finals = load_finals(run_dir, [0, 1, 2, 3])
    assert set(finals) == {0, 1, 2, 3} and finals[0]["step"] == STEPS
    assert_identical(finals)
