"""``unbroken run``: the fault-tolerant replacement for ``torchrun``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from unbroken.launch.launcher import LaunchSettings, run as run_job


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--replicas", type=int, required=True, help="Number of data-parallel replica groups.")
@click.option("--ranks-per-replica", type=int, default=1, show_default=True, help="Processes per replica group.")
@click.option("--min-replicas", type=int, default=None, help="Fewest replicas that may train [default: a majority].")
@click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/latest"), show_default=True)
@click.option("--coordinator", default=None, help="HOST:PORT of an external coordinator (else one starts here).")
@click.option("--port", type=int, default=0, help="Port of the in-process coordinator (0: a free one).")
@click.option("--max-restarts", type=int, default=10, show_default=True, help="Restarts per replica.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(
    replicas: int, ranks_per_replica: int, min_replicas: int | None, run_dir: Path,
    coordinator: str | None, port: int, max_restarts: int, command: tuple[str, ...],
) -> None:
    """Run COMMAND as fault-tolerant replicas: `unbroken run --replicas 3 -- python train.py`."""
    try:
        settings = LaunchSettings(
            command=command, replicas=replicas, ranks_per_replica=ranks_per_replica,
            min_replicas=min_replicas, run_dir=run_dir, coordinator=coordinator, port=port,
            max_restarts=max_restarts,
        )
        code = run_job(settings)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from e
    sys.exit(code)
