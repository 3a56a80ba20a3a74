"""``unbroken bench cluster``: replica groups and real network faults in the cluster box.

One record per scenario of :mod:`unbroken.cluster.scenarios` (its checks, detection and
recovery seconds); root is needed (network namespaces). ``slurm_by_hand`` is the README's Slurm
example, its ``srun`` lines' commands run by hand in the namespaces; ``--slurm`` runs the same
example under a real Slurm (the ``slurm`` scenario: ``slurmctld``, a ``slurmd`` per host), which
needs Debian's ``slurm-wlm`` and ``munge`` (``make slurm``) and so is not in the default set;
nor is ``lossy_link`` (packets dropped with nftables, ``make nftables``), named within 30 steps
in 39 of 40 runs: in every whole-box run it would fail one in 40.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import click

from unbroken.bench.output import publish
from unbroken.cluster import iccl_scenarios, scenarios
from unbroken.cluster.box import unavailable
from unbroken.cluster.slurm import missing as slurm_missing


@click.command()
@click.option("--scenario", "names", multiple=True, help="Run only these (repeatable); default: all.")
@click.option("--slurm", is_flag=True, help="Run the README's Slurm example under a real Slurm (the `slurm` scenario).")
@click.option("--quick", is_flag=True, help="The short forms the test suite runs.")
@click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/bench/cluster-run"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/cluster.json"), show_default=True)
def cluster(names: tuple[str, ...], slurm: bool, quick: bool, run_dir: Path, as_json: bool, out: Path) -> None:
    """Run the cluster-in-a-box scenarios (root needed) and check what must hold under each fault."""
    why = unavailable()
    if why is not None:
        raise click.UsageError(f"cannot build the cluster box: {why}")
    default = (*scenarios.SCENARIOS, *iccl_scenarios.SCENARIOS)
    known = {s.name: s for s in (*default, scenarios.SLURM, scenarios.LOSSY)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.UsageError(f"unknown scenario(s) {unknown}; known: {', '.join(known)}")
    chosen = [known[n] for n in names] if names or slurm else list(default)
    if slurm and scenarios.SLURM not in chosen:
        chosen.append(scenarios.SLURM)
    if scenarios.SLURM in chosen and (why := slurm_missing()) is not None:
        raise click.UsageError(f"cannot run the Slurm scenario: {why}")
    try:
        fresh_run_dir(run_dir)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    records = []
    for sc in chosen:
        t = time.monotonic()
        try:
            record = sc.run(run_dir, quick)
        except Exception as e:  # one scenario's harness failure is its record, not the end of the run
            record = {"scenario": sc.name, "passed": False, "checks": {}, "error": repr(e)[:500]}
        record["wall_s"] = round(time.monotonic() - t, 1)
        records.append(record)
        click.echo(f"{sc.name}: {'passed' if record['passed'] else 'FAILED'}", err=True)
    publish({"scenarios": records, "passed": all(r["passed"] for r in records)}, out, as_json)


MARKER = ".unbroken-bench-cluster"  # a run directory this command made, and may move aside


def fresh_run_dir(run_dir: Path) -> None:
    """An empty run directory: the previous run's (secrets, state, logs: a coordinator would resume
    its finished job) is moved to ``<run-dir>.previous``, replacing the one before it. A non-empty
    directory this command did not make is refused: nothing of anyone else's is moved or deleted."""
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / MARKER).exists():
            raise ValueError(
                f"{run_dir} is not empty and no earlier `unbroken bench cluster` made it: give an empty --run-dir"
            )
        previous = run_dir.with_name(run_dir.name + ".previous")
        if previous.exists():
            if not (previous / MARKER).exists():
                raise ValueError(
                    f"{previous} is in the way and no earlier run made it: move it, or give another --run-dir"
                )
            shutil.rmtree(previous)
        run_dir.rename(previous)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).touch()
