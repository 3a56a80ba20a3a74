"""``unbroken simulate``: cluster-scale what-if questions answered by the goodput model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console

from unbroken.sim.presets import BUILDERS, load_preset, with_cluster

#: CLI option -> Cluster field, for the overrides a user can apply to a preset.
OVERRIDES = {
    "gpus": "gpus",
    "replicas": "replicas",
    "min_replicas": "min_replicas",
    "spare_nodes": "spare_nodes",
    "repair_h": "repair_h",
    "burst_prob": "burst_prob",
    "burst_nodes": "burst_nodes",
}


@click.group()
def simulate() -> None:
    """Model goodput at cluster scale (no GPUs needed)."""


@simulate.command()
@click.option(
    "--preset",
    "preset_name",
    type=click.Choice(sorted(BUILDERS)),
    default="ft-hsdp",
    show_default=True,
    help="Published setting to start from.",
)
@click.option("--gpus", type=int, help="Job size (failure rate per node kept).")
@click.option("--failures-per-1000-node-days", "rate", type=float, help="Node failure rate (Meta's RSC-1 fit is 6.5).")
@click.option("--replicas", type=int, help="Data-parallel replicas.")
@click.option("--min-replicas", type=int, help="Fewest replicas that may train.")
@click.option("--spare-nodes", type=int, help="Spare pool size (default: never runs out).")
@click.option("--repair-h", type=float, help="Hours a failed node spends in repair.")
@click.option("--burst-prob", type=float, help="Share of failure events that are bursts.")
@click.option("--burst-nodes", type=int, help="Nodes one burst takes down.")
@click.option("--years", type=float, default=1.0, show_default=True, help="Simulated years per run.")
@click.option("--runs", type=int, default=20, show_default=True, help="Independent runs (for the CI).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--bench-dir",
    type=click.Path(path_type=Path),
    default=Path("runs/bench"),
    show_default=True,
    help="Where `unbroken bench` wrote recovery/checkpoint/diagnosis.json.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write ETTR vs cluster size (PNG).")
def goodput(
    preset_name: str,
    rate: float | None,
    years: float,
    runs: int,
    seed: int,
    bench_dir: Path,
    as_json: bool,
    plot_path: Path | None,
    **overrides: object,
) -> None:
    """What fraction of wall-clock time trains the model (ETTR), and where the rest goes."""
    from unbroken.sim.evaluation import evaluate, render

    changes = {OVERRIDES[k]: v for k, v in overrides.items() if v is not None}
    if rate is not None:
        changes["node_failure_rate_per_h"] = rate / 1000.0 / 24.0
    try:
        preset = with_cluster(load_preset(preset_name, bench_dir), **changes)
        result = evaluate(preset, years=years, runs=runs, seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if plot_path is not None:
        from unbroken.sim.plot import plot_ettr

        result["plot"] = str(plot_ettr(preset, plot_path, seed=seed))
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        Console().print(render(result))
        if plot_path is not None:
            click.echo(f"plot written to {plot_path}", err=True)
    sys.stdout.flush()
