"""``unbroken bench planner``: ECMP vs the planner vs perfect spraying on a fixed suite.

Scenarios span 64 to 4096 GPUs, one or several jobs, single- and dual-port NICs, with and
without failures. Jobs placed on scattered hosts (as a busy cluster hands them out) keep the
rank-order rings their library would build; the planner may reorder rings, so ECMP with the
planner's rail-aligned rings is reported too, to show how much of the gain is paths alone.
All ECMP numbers come from hashing seeded random source ports; the ideal is the flow
simulation of perfect per-hop spraying; the exact figure is the LP optimum of min-max link
load (small scenarios only).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from unbroken.bench.output import publish
from unbroken.network.compare import compare
from unbroken.network.exact import min_max_load_s
from unbroken.network.topology import Topology, rail_optimized
from unbroken.network.traffic import PHASES, Job

EXACT_MAX_CONNS = 600


@dataclass(frozen=True)
class Scenario:
    name: str
    fabric: dict[str, Any]
    jobs: tuple[dict[str, Any], ...]
    failures: tuple[str, ...] = ()
    scatter: bool = True


def _suite() -> list[Scenario]:
    small = dict(hosts=8, hosts_per_leaf=2, spines=2)
    mid = dict(hosts=32, hosts_per_leaf=8, spines=4, oversubscription=2.0)
    big = dict(hosts=128, hosts_per_leaf=16, spines=8)
    huge = dict(hosts=512, hosts_per_leaf=16, leaves_per_pod=8, spines=16, core_per_spine=4)
    return [
        Scenario("gpu64-1job-1port", small, ({"n": 8, "tp": 8},)),
        Scenario("gpu64-2job-2port", {**small, "ports": 2}, ({"n": 4, "tp": 4, "qps": 2}, {"n": 4, "tp": 8})),
        Scenario(
            "gpu64-2job-2port-linkfail",
            {**small, "ports": 2},
            ({"n": 4, "tp": 4, "qps": 2}, {"n": 4, "tp": 8}),
            ("leaf.p0.b0.r0:spine.p0.pod0.s0",),
        ),
        Scenario("gpu256-2job-1port-oversub2", mid, ({"n": 16, "tp": 8, "qps": 2}, {"n": 16, "tp": 2})),
        Scenario(
            "gpu256-2job-1port-oversub2-linkfail",
            mid,
            ({"n": 16, "tp": 8, "qps": 2}, {"n": 16, "tp": 2}),
            ("leaf.p0.b0.r0:spine.p0.pod0.s0", "leaf.p0.b2.r5:spine.p0.pod0.s3"),
        ),
        Scenario(
            "gpu1024-3job-2port",
            {**big, "ports": 2},
            ({"n": 64, "tp": 8, "qps": 4}, {"n": 32, "tp": 4, "qps": 2}, {"n": 32, "tp": 8, "pp": 2, "qps": 2}),
        ),
        Scenario(
            "gpu1024-3job-2port-contiguous",
            {**big, "ports": 2},
            ({"n": 64, "tp": 8, "qps": 4}, {"n": 32, "tp": 4, "qps": 2}, {"n": 32, "tp": 8, "pp": 2, "qps": 2}),
            scatter=False,
        ),
        Scenario(
            "gpu1024-3job-2port-spinefail",
            {**big, "ports": 2},
            ({"n": 64, "tp": 8, "qps": 4}, {"n": 32, "tp": 4, "qps": 2}, {"n": 32, "tp": 8, "pp": 2, "qps": 2}),
            ("spine.p0.pod0.s3",),
        ),
        Scenario("gpu4096-1job-2port", {**huge, "ports": 2}, ({"n": 512, "tp": 8, "pp": 4, "qps": 4},), scatter=False),
        Scenario(
            "gpu4096-4job-2port-linkfail",
            {**huge, "ports": 2},
            (
                {"n": 256, "tp": 8, "qps": 4},
                {"n": 128, "tp": 4, "qps": 2},
                {"n": 64, "tp": 8, "qps": 2},
                {"n": 64, "tp": 8, "pp": 2, "qps": 2},
            ),
            ("leaf.p0.b0.r0:spine.p0.pod0.s0", "leaf.p1.b5.r3:spine.p1.pod0.s7"),
        ),
    ]


def _jobs(topo: Topology, sc: Scenario, seed: int) -> list[Job]:
    order = (
        np.random.default_rng(seed).permutation(len(topo.hosts)) if sc.scatter else np.arange(len(topo.hosts))
    ).tolist()
    jobs, start = [], 0
    for i, spec in enumerate(sc.jobs):
        spec = dict(spec)
        n = spec.pop("n")
        jobs.append(Job(name=f"job{i}", hosts=tuple(order[start : start + n]), dp_bytes=1e9, **spec))
        start += n
    return jobs


def run_scenario(sc: Scenario, seed: int = 0) -> dict[str, Any]:
    topo = rail_optimized(**sc.fabric)
    jobs = _jobs(topo, sc, seed)
    cmp_ = compare(topo, jobs, sc.failures, seed=seed)
    final = cmp_.failed_plan or cmp_.plan
    dp = "dp"
    exact: float | None = None
    conns = np.flatnonzero(final.traffic.phase == PHASES.index(dp))
    if len(conns) <= EXACT_MAX_CONNS:
        exact = min_max_load_s(final.cands, conns, final.traffic.nbytes, final.topo.capacity_bytes())
    e, p, i = cmp_.ecmp[dp], cmp_.planner[dp], cmp_.ideal[dp]
    row: dict[str, Any] = {
        "name": sc.name,
        "gpus": topo.n_gpus,
        "jobs": len(jobs),
        "failure": bool(sc.failures),
        "ecmp_time_s": e.time_s,
        "planner_time_s": p.time_s,
        "ideal_time_s": i.time_s,
        "exact_time_s": exact,
        "plan_s": round(final.plan_s, 4),
        "ecmp_load_s": e.load_s,
        "planner_load_s": p.load_s,
        "ideal_load_s": i.load_s,
        "bound_time_s": cmp_.bound_s[dp],
        "ecmp_rail_ring_time_s": cmp_.ecmp_rail[dp].time_s,
        "improvement_vs_ecmp": 1 - p.time_s / e.time_s,
        "planner_over_ideal": p.time_s / i.time_s,
        "planner_over_exact": None if exact is None else p.time_s / exact,
        "max_qps": int(final.qps().max()),
        "ecmp_job_time_s": e.job_s,
        "planner_job_time_s": p.job_s,
    }
    if sc.failures:
        local = cmp_.local[dp]
        row.update(
            {
                "failures": list(sc.failures),
                "replan_local_time_s": local.time_s,
                "replan_local_s": round(cmp_.local_plan.plan_s, 4) if cmp_.local_plan else None,
                "replan_reaches_ideal": i.time_s / p.time_s,
                "local_reaches_ideal": i.time_s / local.time_s,
            }
        )
    return row


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    multi = [r for r in rows if r["jobs"] > 1]
    fails = [r for r in rows if r["failure"]]
    big = [r for r in rows if r["gpus"] >= 4096]
    return {
        "worst_planner_over_ideal": max(r["planner_over_ideal"] for r in rows),
        "worst_planner_over_exact": max(
            (r["planner_over_exact"] for r in rows if r["planner_over_exact"] is not None), default=None
        ),
        "min_multi_job_improvement": min((r["improvement_vs_ecmp"] for r in multi), default=None),
        "min_replan_reaches_ideal": min((r["replan_reaches_ideal"] for r in fails), default=None),
        "max_plan_s_4096": max((r["plan_s"] for r in big), default=None),
        "targets": {
            "planner_within_5pct_of_ideal": all(r["planner_over_ideal"] <= 1.05 for r in rows),
            "planner_within_2pct_of_exact": all(
                r["planner_over_exact"] <= 1.02 for r in rows if r["planner_over_exact"] is not None
            ),
            "multi_job_improvement_ge_15pct": all(r["improvement_vs_ecmp"] >= 0.15 for r in multi),
            "replan_ge_95pct_of_ideal": all(r["replan_reaches_ideal"] >= 0.95 for r in fails),
            "plan_4096_le_5s": all(r["plan_s"] <= 5.0 for r in big),
        },
    }


@click.command("planner")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write the JSON (default runs/bench/planner.json).",
)
@click.option("--only", default=None, help="Run only scenarios whose name contains this.")
@click.option("--seed", default=0, show_default=True, help="Seed for placements and ECMP ports.")
def planner(as_json: bool, out: str | None, only: str | None, seed: int) -> None:
    """ECMP vs planner vs perfect spraying, 64 to 4096 GPUs, with and without failures."""
    suite = [s for s in _suite() if not only or only in s.name]
    if not suite:
        raise click.UsageError(f"--only {only!r} matches no scenario; names: " + ", ".join(s.name for s in _suite()))
    rows = []
    t0 = time.perf_counter()
    for sc in suite:
        t = time.perf_counter()
        rows.append(run_scenario(sc, seed))
        r = rows[-1]
        print(
            f"{sc.name}: ecmp {r['ecmp_time_s']:.4f}s planner {r['planner_time_s']:.4f}s "
            f"ideal {r['ideal_time_s']:.4f}s plan {r['plan_s']:.2f}s "
            f"({time.perf_counter() - t:.1f}s)",
            file=sys.stderr,
        )
    result = {
        "benchmark": "planner",
        "seed": seed,
        "scenarios": rows,
        **_summary(rows),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    path = publish(result, out or "runs/bench/planner.json", as_json)
    if not as_json:
        for r in rows:
            click.echo(
                f"{r['name']:34s} ecmp {r['ecmp_time_s']:.4f}  planner "
                f"{r['planner_time_s']:.4f}  ideal {r['ideal_time_s']:.4f}  "
                f"gain {r['improvement_vs_ecmp']:+.1%}  plan {r['plan_s']:.2f}s"
            )
        click.echo(f"written to {path}")
