"""ECMP, the planner and perfect spraying side by side on one cluster and set of jobs.

This is the engine behind ``unbroken plan`` and ``unbroken bench planner``: it builds each
routing, runs the same flow simulator on all of them and, when links fail, compares the
fast local re-weighting with a full re-plan on what is left of the fabric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from unbroken.network.ecmp import device_seeds, ecmp_routing, spray_routing
from unbroken.network.flowsim import Routing, bottleneck_load_s, phase_times
from unbroken.network.paths import Candidates, candidate_paths
from unbroken.network.planner import Plan, plan, replan_local
from unbroken.network.topology import Topology
from unbroken.network.traffic import PHASES, Job, Traffic, build_traffic


@dataclass
class Outcome:
    """One routing's result for one phase: per-job completion times and the worst link."""

    job_s: dict[str, float]
    load_s: float

    @property
    def time_s(self) -> float:
        return max(self.job_s.values(), default=0.0)


@dataclass
class Comparison:
    """Every method's outcome per phase name, plus the plans and timing of planning."""

    phases: list[str]
    ecmp: dict[str, Outcome]
    ecmp_rail: dict[str, Outcome]
    planner: dict[str, Outcome]
    ideal: dict[str, Outcome]
    bound_s: dict[str, float]
    plan: Plan
    local: dict[str, Outcome] = field(default_factory=dict)
    local_plan: Plan | None = None
    failed_plan: Plan | None = None


def outcome(routing: Routing, traffic: Traffic, topo: Topology, phase: str) -> Outcome:
    """Simulates one phase of all jobs running at once under ``routing``."""
    sel = np.flatnonzero(traffic.phase == PHASES.index(phase))
    cap = topo.capacity_bytes()
    sub = routing.subset(sel)
    times = phase_times(sub, traffic.nbytes[sel], traffic.job[sel], cap)
    return Outcome(
        {traffic.jobs[j].name: t for j, t in times.items()}, bottleneck_load_s(sub, traffic.nbytes[sel], cap)
    )


def _ecmp(
    topo: Topology, jobs: Sequence[Job], ring: str | None, qps: int | None, seed: int
) -> tuple[Traffic, Routing, Candidates]:
    traffic = build_traffic(topo, jobs, ring=ring)
    cands = candidate_paths(topo, traffic)
    routing, _ = ecmp_routing(cands, traffic, device_seeds(topo), qps, np.random.default_rng(seed))
    return traffic, routing, cands


def compare(
    topo: Topology,
    jobs: Sequence[Job],
    failures: Sequence[str] = (),
    ecmp_qps: int | None = None,
    seed: int = 0,
    max_qps: int = 8,
) -> Comparison:
    """Runs every method; with ``failures`` the planner and ECMP numbers are after them.

    ECMP uses each job's own ring order and QP count (or ``ecmp_qps``) and reconverges on the
    surviving equal-cost paths; the planner's numbers after a failure are a full re-plan, and
    the local re-weighting of the pre-failure plan is reported beside it.
    """
    before = plan(topo, jobs, max_qps=max_qps)
    live = topo.with_failures(failures) if failures else topo
    traffic, routing, _ = _ecmp(live, jobs, None, ecmp_qps, seed)
    traffic_r, routing_r, _ = _ecmp(live, jobs, "rail", ecmp_qps, seed)
    final = plan(live, jobs, max_qps=max_qps) if failures else before
    phases = [p for p in PHASES if (final.traffic.phase == PHASES.index(p)).any()]
    spray = spray_routing(final.cands)
    planned = final.routing()
    out = Comparison(
        phases=phases,
        ecmp={p: outcome(routing, traffic, live, p) for p in phases},
        ecmp_rail={p: outcome(routing_r, traffic_r, live, p) for p in phases},
        planner={p: outcome(planned, final.traffic, live, p) for p in phases},
        ideal={p: outcome(spray, final.traffic, live, p) for p in phases},
        bound_s={p: final.bound_s.get(PHASES.index(p), 0.0) for p in phases},
        plan=before,
    )
    if failures:
        local = replan_local(before, live, max_qps=max_qps)
        out.local_plan, out.failed_plan = local, final
        out.local = {p: outcome(local.routing(), local.traffic, live, p) for p in phases}
    return out
