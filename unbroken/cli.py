"""The ``unbroken`` command.

Each subcommand lives next to the code it drives and is imported only when invoked, so
``unbroken --help`` stays fast and a broken optional part cannot break the others.
"""

from __future__ import annotations

import importlib

import click

from unbroken import fast_exit
from unbroken.extras import MissingExtra

# name -> "module:attribute" of a click command or group.
COMMANDS: dict[str, str] = {
    "bench": "unbroken.bench.bench_cli:bench",
    "coordinator": "unbroken.control.coordinator_cli:coordinator",
    "run": "unbroken.launch.run.run_cli:run",
    "demo": "unbroken.launch.run.demo:demo",
    "simulate": "unbroken.sim.simulate_cli:simulate",
    "plan": "unbroken.network.plan_cli:plan",
    "checkpoint": "unbroken.checkpoint.checkpoint_cli:checkpoint",
    "status": "unbroken.control.status:status",
    "agent": "unbroken.launch.node.agent_cli:agent",
    "secret": "unbroken.control.state.secret_file:secret",
    "k8s": "unbroken.k8s.k8s_cli:k8s",
}

# name -> "module:attribute" of the `unbroken bench NAME` scenarios: the one list of them
# (`unbroken bench --help` shows it; tests/unit/test_docs.py holds the docs to it).
BENCHMARKS: dict[str, str] = {
    "planner": "unbroken.bench.network.planner_vs_ecmp:planner",
    "checkpoint": "unbroken.bench.training.checkpoint:checkpoint",
    "recovery": "unbroken.bench.training.recovery:recovery",
    "diagnosis": "unbroken.bench.network.diagnosis:diagnosis",
    "auth": "unbroken.bench.control_plane.auth_cost:auth",
    "cluster": "unbroken.bench.network.cluster:cluster",
    "metrics": "unbroken.bench.training.metrics_scrape:metrics",
    "coordinator": "unbroken.bench.control_plane.coordinator_load:coordinator",
    "epochs": "unbroken.bench.control_plane.epochs:epochs",
    "iccl": "unbroken.bench.network.iccl:iccl",
    "abuse": "unbroken.bench.control_plane.abuse:abuse",
    "rendezvous": "unbroken.bench.control_plane.rendezvous:rendezvous",
    "lease": "unbroken.bench.control_plane.lease_filesystems:lease",
    "torchtitan": "unbroken.bench.training.titan_trainer:torchtitan",
    "torchft-ddp": "unbroken.bench.training.ddp_example:torchft_ddp",
    "sdc": "unbroken.bench.training.sdc:sdc",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def __init__(self, *args: object, lazy: dict[str, str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            module_name, attr = self._lazy[cmd_name].split(":")
            try:
                return getattr(importlib.import_module(module_name), attr)
            except MissingExtra as e:
                return _unavailable(cmd_name, e)
        return super().get_command(ctx, cmd_name)


def _unavailable(name: str, error: MissingExtra) -> click.Command:
    """Stands in for a subcommand whose optional dependencies are not installed: it is still
    listed by ``--help``, and running it (``--help`` included) says which extra to install."""

    def fail(**_: object) -> None:
        raise click.ClickException(str(error))

    return click.Command(
        name,
        callback=fail,
        help=f"(not installed) {error}",
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        context_settings={"ignore_unknown_options": True, "help_option_names": []},
    )


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.version_option(package_name="unbroken")
def main() -> None:
    """Fault-tolerant training for PyTorch: run, watch, diagnose, checkpoint, plan."""
    fast_exit.install()
