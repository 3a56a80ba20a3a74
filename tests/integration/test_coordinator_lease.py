"""A hung coordinator loses its lease: the standby takes over, the hung one steps down mute.

Real processes: an active ``unbroken coordinator``, a ``--standby`` on the same state
directory, two node agents running the example GPT with both addresses. The active one is
stopped (SIGSTOP: alive, holding its lock and its clients' connections); the standby must take
over within its lease plus a margin, the workers must find it without a restart. Then the old
one is woken (SIGCONT): it must answer nothing and exit, stepping down.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.harness import Processes, assert_identical, load_finals, wait_for_step
from tests.integration.test_agents import Cluster, wait_until
from unbroken.control.coordinator_cli import STEPPED_DOWN
from unbroken.control.state.lease import LeaseFiles

pytestmark = pytest.mark.integration
STEPS = 90
LEASE_S = 1.0
# The standby's takeover within the lease, its poll, opening the state, and a loaded machine.
MARGIN_S = 3.0


def test_a_standby_takes_over_a_hung_coordinator_which_steps_down_when_it_wakes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old_log, log = tmp_path / "coordinator.log", tmp_path / "coordinator--standby.log"  # Processes' names
    with Processes(tmp_path) as ps:
        cluster = Cluster(ps, run_dir, replicas=2, min_replicas=1, standby=True)
        cluster.agent("a", steps=STEPS)
        cluster.agent("b", steps=STEPS)
        wait_for_step(run_dir, 0, 8, timeout=90)
        active = ps.procs[0]
        try:
            os.kill(active.pid, signal.SIGSTOP)
            stopped = time.time()
            wait_until("the standby to take over", lambda: b"standby took over" in log.read_bytes(), timeout=30)
            took_over = time.time()
            assert b"its lease lapsed (it hangs)" in log.read_bytes()
            resumed = wait_until(
                "the standby to resume the epoch",
                lambda: [e for e in cluster.events("epoch_resumed") if e["t"] > stopped],
            )[0]
            print(
                f"takeover: standby listening {took_over - stopped:.2f}s, "
                f"epoch {resumed['epoch']} resumed {resumed['t'] - stopped:.2f}s after SIGSTOP"
            )
            assert took_over - stopped < LEASE_S + MARGIN_S
            assert resumed["members"] == [0, 1]  # nobody restarted or behind
            wait_for_step(run_dir, 0, resumed["step"] + 5, timeout=60)  # training goes on without it
            # The agents, too, take the silent coordinator for hung and move to the standby while
            # it is still stopped (it answers every heartbeat when it runs).
            wait_until(
                "the agents to leave the hung coordinator",
                lambda: all(cluster.agent_events(n, "coordinator_reconnected") for n in "ab"),
                timeout=30,
            )
            assert all(cluster.agent_events(n, "coordinator_silent") for n in "ab")
        finally:
            os.kill(active.pid, signal.SIGCONT)
        assert active.wait(30) == STEPPED_DOWN
        # Gone, its lock is free: the new holder takes it (a plain coordinator would be refused).
        wait_until("the lock to be taken", lambda: b"took the state directory's lock" in log.read_bytes(), 10)
        cluster.wait_agents(["a", "b"])
        text = old_log.read_text()
    assert "stepped down: the lease went to term 2" in text, text
    files = LeaseFiles(run_dir)
    newest = files.newest()
    assert newest is not None and newest.term == 2 and f"pid {ps.procs[1].pid} " in newest.holder
    for node, replica in (("a", 0), ("b", 1)):
        assert [e["replica"] for e in cluster.agent_events(node, "process_started")] == [replica]  # never restarted
    quorums = cluster.events("quorum")
    epochs = [q["epoch"] for q in quorums]
    # One coordinator issues at a time: the old one issued nothing after the stop (its epochs
    # lie below the standby's, so one would break the order here), before or after it woke.
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs), "two coordinators issued epochs"
    before = [q for q in quorums if q["t"] < stopped]
    # The standby trains on in the epoch the job trained in (no group rebuilt), and forms none.
    assert before and before[-1]["epoch"] == resumed["epoch"]
    assert not [q for q in quorums if q["t"] > stopped], "an epoch formed after the stop: every group was rebuilt"
    assert not cluster.events("resume_given_up")
    finals = load_finals(run_dir, [0, 1])
    assert finals[0]["step"] == STEPS
    assert_identical(finals)
