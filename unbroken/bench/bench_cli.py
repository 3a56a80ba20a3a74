"""``unbroken bench``: the group whose scenarios are listed in :data:`unbroken.cli.BENCHMARKS`."""

from __future__ import annotations

import click

from unbroken.cli import BENCHMARKS, LazyGroup


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench() -> None:
    """Measure unbroken against its baselines; every scenario prints JSON with --json."""
