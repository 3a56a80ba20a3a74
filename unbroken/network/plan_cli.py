"""``unbroken plan``: plan a cluster's collective traffic and compare it with ECMP."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from unbroken.network.adapter import assignment_json, library_settings
from unbroken.network.compare import compare
from unbroken.network.topology import load_topology
from unbroken.network.traffic import load_jobs


@click.command("plan")
@click.option(
    "--topology",
    "topology_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Topology YAML/JSON (explicit, or 'generator: rail_optimized' with its arguments).",
)
@click.option(
    "--jobs",
    "jobs_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Jobs YAML/JSON: a list under 'jobs' with hosts, tp, pp, dp_bytes, ring, qps.",
)
@click.option(
    "--fail",
    "failures",
    multiple=True,
    help="A failed link 'a:b', a degraded one 'a:b@0.5', or a switch name (repeatable).",
)
@click.option(
    "--out",
    default="runs/plan/assignment.json",
    show_default=True,
    help="Where to write the per-connection assignment.",
)
@click.option(
    "--adapter",
    "adapter_out",
    default="runs/plan/settings.json",
    show_default=True,
    help="Where to write the collective-library settings (rings, QPs, source ports).",
)
@click.option(
    "--ecmp-qps",
    type=click.IntRange(min=1),
    default=None,
    help="QPs per connection for the ECMP baseline (default: each job's own).",
)
@click.option(
    "--max-qps",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Most QPs the planner may split a connection into.",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the ECMP source ports.")
def plan(
    topology_path: str,
    jobs_path: str,
    failures: tuple[str, ...],
    out: str,
    adapter_out: str,
    ecmp_qps: int | None,
    max_qps: int,
    seed: int,
) -> None:
    """Which port and path each connection should use, and what that buys over ECMP."""
    try:
        topo = load_topology(topology_path)
        jobs = load_jobs(jobs_path, topo)
        result = compare(topo, jobs, failures, ecmp_qps=ecmp_qps, seed=seed, max_qps=max_qps)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    final = result.failed_plan or result.plan
    table = Table(
        title=f"collective time per step phase, s ({topo.n_gpus} GPUs, "
        f"{len(jobs)} job(s){', after ' + ', '.join(failures) if failures else ''})"
    )
    for col in ("phase", "job", "ECMP", "planner", "ideal (spray)", "gain vs ECMP"):
        table.add_column(col, justify="left" if col in ("phase", "job") else "right")
    if failures:
        table.add_column("local re-weight", justify="right")
    for ph in result.phases:
        for job in jobs:
            e, p, i = (getattr(result, m)[ph].job_s.get(job.name) for m in ("ecmp", "planner", "ideal"))
            if e is None or p is None:
                continue
            cells = [ph, job.name, f"{e:.4f}", f"{p:.4f}", f"{i:.4f}", f"{1 - p / e:+.1%}"]
            if failures:
                cells.append(f"{result.local[ph].job_s[job.name]:.4f}")
            table.add_row(*cells)
    console = Console()
    console.print(table)
    console.print(
        "capacity bound per phase: "
        + ", ".join(f"{k} {v:.4f}s" for k, v in result.bound_s.items())
        + f"; planning took {final.plan_s:.2f}s"
        + (f"; local re-weight took {result.local_plan.plan_s:.3f}s" if result.local_plan else "")
    )
    for path, data in ((out, assignment_json(final)), (adapter_out, library_settings(final))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")
    console.print(f"assignment: {out}\nlibrary settings: {adapter_out}")
