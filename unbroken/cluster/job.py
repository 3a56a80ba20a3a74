"""A job in the cluster box: the coordinator on its own host, one ``unbroken agent`` per host.

Everything is started as a cluster's scheduler would (``srun`` lines, run by hand in the
namespaces): ``unbroken coordinator --host 198.18.0.1`` in the coordinator's namespace, then an
agent per host that reaches it over the bridge and advertises its own address. The workers are
:mod:`unbroken.cluster.worker`. The checks every scenario shares are here too: no step committed
by two quorums, epochs that only grow, replicas bitwise identical at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from unbroken.cluster.box import Box
from unbroken.config import ENV_PYTHONPATH, ENV_SECRET_FILE, python_path
from unbroken.k8s import commands
from unbroken.observe.events import read_events, read_jsonl
from unbroken.wire.auth import JobSecret

COORDINATOR_PORT = 29400  # each host is a namespace of its own: no port is taken there
PROG = (sys.executable, "-m", "unbroken")  # `unbroken` without relying on PATH
T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T], timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


@dataclasses.dataclass
class JobSpec:
    """The job: replicas of ``nodes_per_replica`` hosts with ``ranks_per_replica`` ranks in all."""

    replicas: int
    min_replicas: int
    steps: int = 60
    nodes_per_replica: int = 1
    ranks_per_replica: int = 1
    width: int = 128
    pace_s: float = 0.1
    heartbeat_timeout_s: float = 2.0
    worker_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Where the coordinator runs and what it binds: its own host by default; the Slurm example
    # runs it on the first node, next to that node's agent, bound to 0.0.0.0.
    coordinator_host: str = "ctl"
    coordinator_bind: str | None = None
    # The plane the control traffic (coordinator, store) takes in a box with two paths: 1 keeps
    # it off the primary data plane, as a management network would, so that a data-plane NIC
    # fault (``nic_*`` scenarios) is not also a partition from the coordinator.
    control_plane: int = 0
    hot_spares: int = 0  # replicas beyond ``replicas`` the coordinator keeps waiting as spares


class BoxJob:
    """A coordinator and agents in ``box``; logs, events and metrics in ``run_dir``."""

    def __init__(self, box: Box, run_dir: Path, spec: JobSpec) -> None:
        self.box, self.run_dir, self.spec = box, run_dir, spec
        run_dir.mkdir(parents=True, exist_ok=True)
        self.secret_file = JobSecret.generate().write(run_dir / "secret")
        ctl = box.host(spec.coordinator_host)
        self.address = f"{ctl.addr2 if spec.control_plane else ctl.addr}:{COORDINATOR_PORT}"
        self.agents: dict[str, Any] = {}
        self.coordinator: Any = None
        self.target = spec.steps  # the step the job ends at
        root = str(Path(__file__).resolve().parents[2])
        self.env = {
            **os.environ,
            ENV_PYTHONPATH: os.pathsep.join(filter(None, [root, python_path()])),
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
            ENV_SECRET_FILE: str(self.secret_file),
            **spec.worker_env,
        }

    def start_coordinator(self) -> None:
        s = self.spec
        self.coordinator = self.box.spawn(
            s.coordinator_host, self.coordinator_argv(), self.run_dir / "coordinator.log", self.env
        )
        wait_until("the coordinator to listen", lambda: self.events("coordinator_started"), 60)

    def coordinator_argv(self) -> list[str]:
        """The coordinator's command line, built as the Kubernetes manifests build theirs."""
        s = self.spec
        return commands.coordinator_argv(
            PROG,
            commands.CoordinatorArgs(
                host=s.coordinator_bind or self.address.rpartition(":")[0],
                port=COORDINATOR_PORT,
                replicas=s.replicas,
                min_replicas=s.min_replicas,
                state_dir=str(self.run_dir),
                startup_window_s=3,
                heartbeat_timeout_s=s.heartbeat_timeout_s,
                hot_spares=s.hot_spares,
            ),
        )

    def agent_argv(self, host: str) -> list[str]:
        """``host``'s agent's command line, built as the Kubernetes manifests build theirs."""
        s = self.spec
        args = commands.AgentArgs(
            coordinators=(self.address,),
            node=host,
            run_dir=str(self.run_dir),
            secret_file=str(self.secret_file),
            ranks_per_replica=s.ranks_per_replica,
            nodes_per_replica=s.nodes_per_replica,
            connect_timeout_s=60,
        )
        return commands.agent_argv(PROG, args, self.worker_argv())

    def worker_argv(self) -> list[str]:
        s = self.spec
        return [sys.executable, "-m", "unbroken.cluster.worker", "--steps", str(s.steps)] + [
            "--width",
            str(s.width),
            "--pace-s",
            str(s.pace_s),
            "--stop-file",
            str(self.stop_file),
        ]

    @property
    def stop_file(self) -> Path:
        return self.run_dir / "stop-at"

    def finish_in(self, steps: int) -> int:
        """Ends the job ``steps`` after the furthest replica's step (every replica ends there)."""
        last = max(self.step_of(r) for r in range(self.spec.replicas)) + 1 + steps
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text(str(last))
        tmp.replace(self.stop_file)
        self.target = last
        return last

    def start_agent(self, host: str) -> None:
        """Starts ``host``'s agent and waits until the coordinator has registered it (joins in order)."""
        self.agents[host] = self.box.spawn(host, self.agent_argv(host), self.run_dir / f"agent-{host}.log", self.env)
        wait_until(f"agent {host} to join", lambda: any(e["node"] == host for e in self.events("agent_joined")), 60)

    def start(self, hosts: list[str]) -> None:
        self.start_coordinator()
        for h in hosts:
            self.start_agent(h)

    # -- what happened -----------------------------------------------------------------------

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_events(self.run_dir / "events.jsonl") if kind is None or e["kind"] == kind]

    def agent_events(self, host: str, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.run_dir / f"events-{host}.jsonl") if e["kind"] == kind]

    def metrics(self, replica: int) -> list[dict[str, Any]]:
        return list(read_jsonl(self.run_dir / f"metrics-r{replica}.jsonl"))

    def step_of(self, replica: int) -> int:
        rows = [r for r in self.metrics(replica) if r.get("committed")]
        return rows[-1]["step"] if rows else -1

    def wait_for_step(self, replica: int, step: int, timeout: float = 90.0) -> None:
        wait_until(f"replica {replica} to commit step {step}", lambda: self.step_of(replica) >= step, timeout)

    def wait_agents(self, hosts: list[str], timeout: float = 120.0) -> dict[str, int | None]:
        """Waits (bounded) for the agents to end; their exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for h in hosts:
            try:
                codes[h] = self.agents[h].wait(max(0.1, deadline - time.monotonic()))
            except Exception:
                codes[h] = None
        return codes

    def finals(self) -> dict[int, dict[int, dict[str, Any]]]:
        """replica -> rank -> its final step and digest."""
        out: dict[int, dict[int, dict[str, Any]]] = {}
        for path in self.run_dir.glob("final-r*-rank*.json"):
            r, k = path.stem.removeprefix("final-r").split("-rank")
            out.setdefault(int(r), {})[int(k)] = json.loads(path.read_text())
        return out


def consistency(job: BoxJob, replicas: list[int]) -> dict[str, Any]:
    """The invariants every scenario checks, as named booleans plus the evidence.

    * ``one_quorum_per_step``: no step was committed under two different epochs (two quorums);
    * ``epochs_grow``: the coordinator's epochs strictly increase;
    * ``identical``: every replica in ``replicas`` ended at the same step with bitwise-identical
      state (rank by rank);
    * ``finished``: they all reached the job's last step.
    """
    committed: dict[int, set[int]] = {}
    for r in range(job.spec.replicas + job.spec.hot_spares):
        for row in job.metrics(r):
            if row.get("committed") and row.get("epoch") is not None:
                committed.setdefault(row["step"], set()).add(row["epoch"])
    split = {s: sorted(e) for s, e in committed.items() if len(e) > 1}
    epochs = [q["epoch"] for q in job.events("quorum")]
    finals = job.finals()
    digests = {r: {k: v["digest"] for k, v in finals.get(r, {}).items()} for r in replicas}
    steps = {r: {v["step"] for v in finals.get(r, {}).values()} for r in replicas}
    identical = bool(digests) and all(digests[r] and digests[r] == digests[replicas[0]] for r in replicas)
    return {
        "one_quorum_per_step": not split and bool(committed),
        "steps_committed_by_two_quorums": len(split),
        "epochs_grow": all(a < b for a, b in zip(epochs, epochs[1:], strict=False)),
        "identical": identical,
        "finished": all(steps[r] == {job.target} for r in replicas),
        "last_committed_step": max(committed, default=-1),
    }
