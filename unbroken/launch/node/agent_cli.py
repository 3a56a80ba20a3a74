"""``unbroken agent``: join a multi-node job's coordinator and run this node's replicas."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import click

from unbroken.control.state import secret_file as secrets
from unbroken.launch.node.agent import AgentSettings
from unbroken.launch.node.agent import run as run_agent
from unbroken.launch.options import cross_replica_backend_option
from unbroken.launch.policy import RestartPolicy
from unbroken.launch.supervisor_core import DEFAULT_TERM_GRACE_S


@click.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "--coordinator",
    required=True,
    metavar="HOST:PORT",
    help="The job's coordinator (started with `unbroken coordinator`).",
)
@click.option(
    "--node", default=socket.gethostname, show_default="this host's name", help="This node's name, unique in the job."
)
@click.option(
    "--slots",
    type=int,
    default=AgentSettings.slots,
    show_default=True,
    help="Replicas this node can run; slots beyond its share are spares for other nodes' replicas.",
)
@click.option(
    "--ranks-per-replica",
    type=int,
    default=AgentSettings.ranks_per_replica,
    show_default=True,
    help="Processes per replica group (its WORLD_SIZE), over all the nodes it spans.",
)
@click.option(
    "--nodes-per-replica",
    type=int,
    default=1,
    show_default=True,
    help="Nodes each replica group spans (every agent of the job says the same); each node runs "
    "ranks-per-replica / nodes-per-replica of its ranks. Losing any of them restarts the whole group.",
)
@click.option(
    "--advertise-addr",
    default=None,
    metavar="IP",
    help="The address the other nodes of a replica group reach this node at; its group's rendezvous "
    "binds it [default: the address this node uses to reach the coordinator].",
)
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    default=AgentSettings.run_dir,
    show_default=True,
    help="Logs and events (a shared filesystem on a cluster).",
)
@click.option(
    "--max-restarts",
    type=int,
    default=RestartPolicy.max_restarts_per_replica,
    show_default=True,
    help="Restarts per replica on this node.",
)
@click.option(
    "--backoff",
    type=float,
    default=RestartPolicy.backoff_initial_s,
    show_default=True,
    help="First restart delay in seconds; doubles per failure without progress.",
)
@click.option(
    "--connect-timeout",
    type=float,
    default=AgentSettings.connect_timeout_s,
    show_default=True,
    help=(
        "Seconds to wait for the coordinator to answer, at start and after it went away "
        "(a restarted one takes the agent back)."
    ),
)
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path),
    default=None,
    help="The job's secret: a copy of the `secret` file in the coordinator's --state-dir "
    "[default: $UNBROKEN_SECRET_FILE].",
)
@click.option(
    "--term-grace-s",
    type=float,
    default=DEFAULT_TERM_GRACE_S,
    show_default=True,
    help="On SIGTERM (preemption, scancel, eviction): seconds the workers have to finish their step "
    "and flush a checkpoint before the rest is killed.",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@click.option(
    "--http-port",
    type=int,
    default=None,
    help="Serve /metrics and a dashboard of this node's replicas at this port (0: a free one) [default: none].",
)
@click.option("--http-host", default="127.0.0.1", show_default=True, help="Address --http-port binds.")
@click.option(
    "--relay/--no-relay",
    default=True,
    show_default=True,
    help="Speak for this node's ranks through one connection to the coordinator (its load is then the "
    "node count); --no-relay: each rank connects to the coordinator itself.",
)
@cross_replica_backend_option
def agent(**kw: Any) -> None:
    """Run this node's share of a job: `unbroken agent --coordinator HOST:PORT --secret-file S -- python train.py`.

    Exit codes: 0 the job finished, 1 it ended without this node's replicas finishing, 78 and 95
    the coordinator ended the job (a configuration that can never work; no progress), 130 Ctrl-C,
    143 SIGTERM (the workers were told to flush a checkpoint).
    """
    try:
        backoff = kw.pop("backoff")
        if kw["max_restarts"] < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {kw['max_restarts']}")
        found = secrets.given(kw.pop("secret_file"))
        policy = RestartPolicy(
            backoff_initial_s=backoff,
            backoff_max_s=max(RestartPolicy.backoff_max_s, backoff),
            max_restarts_per_replica=kw.pop("max_restarts"),
        )
        settings = AgentSettings(
            command=kw.pop("command"),
            coordinator=kw.pop("coordinator"),
            node=kw.pop("node"),
            slots=kw.pop("slots"),
            ranks_per_replica=kw.pop("ranks_per_replica"),
            nodes_per_replica=kw.pop("nodes_per_replica"),
            advertise_addr=kw.pop("advertise_addr"),
            run_dir=kw.pop("run_dir"),
            policy=policy,
            connect_timeout_s=kw.pop("connect_timeout"),
            secret_file=found[1] if found is not None else None,
            term_grace_s=kw.pop("term_grace_s"),
            http_port=kw.pop("http_port"),
            http_host=kw.pop("http_host"),
            cross_replica_backend=kw.pop("cross_replica_backend"),
            relay=kw.pop("relay"),
        )
        code = run_agent(settings)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from e
    sys.exit(code)
