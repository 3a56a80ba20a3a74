"""The command lines of a multi-node job's processes, built in one place.

``unbroken coordinator`` and ``unbroken agent`` are started by whoever runs the job: the cluster
box (:mod:`unbroken.cluster.job`), the Kubernetes manifests (:mod:`unbroken.k8s.render`), a
Slurm script. Both of the first two build their argv here, so that what a pod runs is what the
box's scenarios exercise. Pure: values in, a list of strings out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def _num(x: float) -> str:
    """A number as a command line takes it (``3``, not ``3.0``)."""
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclasses.dataclass(frozen=True)
class CoordinatorArgs:
    """What ``unbroken coordinator`` is started with; None leaves the command's default."""

    host: str
    port: int
    replicas: int
    min_replicas: int
    state_dir: str
    startup_window_s: float | None = None
    heartbeat_timeout_s: float | None = None
    secret_file: str | None = None
    http_port: int | None = None
    standby: bool = False
    no_progress_timeout_s: float | None = None
    hot_spares: int = 0


def coordinator_argv(prog: Sequence[str], a: CoordinatorArgs) -> list[str]:
    """``prog`` (``["unbroken"]``, or ``[python, "-m", "unbroken"]``) then the coordinator's options."""
    argv = [*prog, "coordinator", "--host", a.host, "--port", str(a.port)]
    argv += ["--replicas", str(a.replicas), "--min-replicas", str(a.min_replicas), "--state-dir", a.state_dir]
    if a.startup_window_s is not None:
        argv += ["--startup-window", _num(a.startup_window_s)]
    if a.heartbeat_timeout_s is not None:
        argv += ["--heartbeat-timeout", _num(a.heartbeat_timeout_s)]
    if a.no_progress_timeout_s is not None:
        argv += ["--no-progress-timeout", _num(a.no_progress_timeout_s)]
    if a.secret_file is not None:
        argv += ["--secret-file", a.secret_file]
    if a.http_port is not None:
        argv += ["--http-port", str(a.http_port)]
    if a.hot_spares:
        argv += ["--hot-spares", str(a.hot_spares)]
    if a.standby:
        argv.append("--standby")
    return argv


@dataclasses.dataclass(frozen=True)
class AgentArgs:
    """What ``unbroken agent`` is started with; None leaves the command's default."""

    coordinators: tuple[str, ...]  # HOST:PORT of the active coordinator, then its standby
    node: str
    run_dir: str
    secret_file: str
    ranks_per_replica: int = 1
    nodes_per_replica: int = 1
    slots: int | None = None
    advertise_addr: str | None = None
    connect_timeout_s: float | None = None
    term_grace_s: float | None = None


def agent_argv(prog: Sequence[str], a: AgentArgs, worker: Sequence[str]) -> list[str]:
    """``prog`` then the agent's options, ``--``, and the worker's own command line."""
    if not a.coordinators:
        raise ValueError("an agent needs at least one coordinator address (HOST:PORT)")
    if not worker:
        raise ValueError("an agent needs the training command to run after `--` (e.g. python train.py)")
    argv = [*prog, "agent", "--coordinator", ",".join(a.coordinators), "--node", a.node]
    if a.slots is not None:
        argv += ["--slots", str(a.slots)]
    argv += ["--ranks-per-replica", str(a.ranks_per_replica), "--nodes-per-replica", str(a.nodes_per_replica)]
    if a.advertise_addr is not None:
        argv += ["--advertise-addr", a.advertise_addr]
    argv += ["--run-dir", a.run_dir, "--secret-file", a.secret_file]
    if a.connect_timeout_s is not None:
        argv += ["--connect-timeout", _num(a.connect_timeout_s)]
    if a.term_grace_s is not None:
        argv += ["--term-grace-s", _num(a.term_grace_s)]
    return [*argv, "--", *worker]
