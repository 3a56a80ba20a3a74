"""The planner against ECMP, the capacity bound and the exact LP; re-planning on failures."""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.network.adapter import assignment_json, library_settings
from unbroken.network.compare import compare
from unbroken.network.ecmp import device_seeds, hashed_rows
from unbroken.network.exact import min_max_load_s
from unbroken.network.flowsim import bottleneck_load_s, phase_times
from unbroken.network.planner import plan, replan_local
from unbroken.network.topology import DOWN, Topology, rail_optimized
from unbroken.network.traffic import PHASES, Job


def _dp(p):
    return np.flatnonzero(p.traffic.phase == PHASES.index("dp"))


def test_planner_beats_ecmp_and_reaches_the_bound(fabric: Topology, scattered_jobs) -> None:
    cmp_ = compare(fabric, scattered_jobs, seed=1)
    dp = cmp_.planner["dp"]
    assert dp.time_s == pytest.approx(cmp_.bound_s["dp"], rel=0.01)
    assert dp.time_s < cmp_.ecmp["dp"].time_s
    assert dp.time_s <= cmp_.ideal["dp"].time_s * 1.0001


def test_dual_port_connections_use_both_ports(fabric: Topology) -> None:
    p = plan(fabric, [Job("a", (0, 2, 4, 6), tp=8)])
    rows, weights = p.choices()
    for c in range(len(rows)):
        ports = {fabric.links[int(p.cands.paths[c][r][0])][0][-1] for r in rows[c]}
        assert ports == {"0", "1"}
        np.testing.assert_allclose(weights[c], 0.5)


def test_splitting_balances_an_oversubscribed_leaf() -> None:
    # 3 cross-leaf flows per leaf over 2 uplinks: whole flows leave one uplink with 2
    topo = rail_optimized(6, gpus_per_host=1, hosts_per_leaf=3, spines=2, oversubscription=1.5)
    job = Job("a", (0, 3, 1, 4, 2, 5), tp=1, dp_bytes=1e9)
    whole = plan(topo, [job], ring="rank", max_qps=1)
    split = plan(topo, [job], ring="rank", max_qps=8)
    cap = topo.capacity_bytes()
    load_whole = bottleneck_load_s(whole.routing(), whole.traffic.nbytes, cap)
    load_split = bottleneck_load_s(split.routing(), split.traffic.nbytes, cap)
    assert load_split < load_whole
    exact = min_max_load_s(split.cands, _dp(split), split.traffic.nbytes, cap)
    assert exact <= load_split * (1 + 1e-6)
    assert load_split <= exact * 1.02
    assert split.qps().max() > 1


def test_exact_lp_and_milp_bound_the_planner(fabric: Topology, scattered_jobs) -> None:
    p = plan(fabric, scattered_jobs)
    cap = fabric.capacity_bytes()
    conns = _dp(p)
    lp = min_max_load_s(p.cands, conns, p.traffic.nbytes, cap)
    single = min_max_load_s(p.cands, conns, p.traffic.nbytes, cap, qps=1)
    planned = bottleneck_load_s(p.routing().subset(conns), p.traffic.nbytes[conns], cap)
    assert lp <= single + 1e-12
    assert lp <= planned * (1 + 1e-6) <= lp * 1.02


def test_local_reweight_moves_only_affected_connections(fabric: Topology, scattered_jobs) -> None:
    before = plan(fabric, scattered_jobs)
    rows_before, _ = before.choices()
    # fail a link that the plan actually uses
    used = {
        int(link_id)
        for c, r in zip(before.unit_conn, before.unit_row, strict=False)
        for link_id in before.cands.paths[c][r]
        if link_id != before.cands.pad
    }
    link = next(
        i for i in sorted(used) if fabric.links[i][0].startswith("leaf") and fabric.links[i][1].startswith("spine")
    )
    a, b = fabric.links[link]
    failed = fabric.with_failures([f"{a}:{b}"])
    local = replan_local(before, failed)
    full = plan(failed, scattered_jobs)
    dead = {i for i, s in enumerate(failed.state) if s == DOWN}
    for p in (local, full):
        for c, r in zip(p.unit_conn, p.unit_row, strict=False):
            assert not dead & set(p.cands.paths[c][r].tolist())
    cap = failed.capacity_bytes()
    t_local = max(phase_times(local.routing(), local.traffic.nbytes, local.traffic.job, cap).values())
    t_full = max(phase_times(full.routing(), full.traffic.nbytes, full.traffic.job, cap).values())
    assert np.isfinite(t_local) and t_full <= t_local * (1 + 1e-9)
    unaffected = [
        c
        for c in range(len(rows_before))
        if not any(dead & set(before.cands.paths[c][r].tolist()) for r in rows_before[c])
    ]
    assert unaffected
    rows_local, _ = local.choices()
    for c in unaffected:
        old = [tuple(before.cands.paths[c][r]) for r in rows_before[c]]
        new = [tuple(local.cands.paths[c][r]) for r in rows_local[c]]
        assert old == new


def test_adapter_source_ports_reproduce_the_plan(fabric: Topology, scattered_jobs) -> None:
    p = plan(fabric, scattered_jobs)
    settings = library_settings(p)
    seeds = device_seeds(fabric)
    rows, _ = p.choices()
    entries = [e for job in settings["jobs"].values() for e in job["connections"]]
    assert len(entries) == len(p.traffic)
    for c, e in enumerate(entries):
        if e.get("nvlink"):
            continue
        sports = np.array([q["sport"] for q in e["qps"]])
        landed = set(
            hashed_rows(p.cands.paths[c], int(p.traffic.src[c]), int(p.traffic.dst[c]), sports, seeds).tolist()
        )
        assert landed == set(rows[c].tolist())
    rings = settings["jobs"]["a"]["rings"]
    assert len(rings) == 8 and sorted(rings[0]) == [0, 8, 16, 24]
    conns = assignment_json(p)["connections"]
    assert all(abs(sum(x["share"] for x in c["paths"]) - 1) < 1e-5 for c in conns)


def test_plan_survives_a_nic_port_failure() -> None:
    topo = rail_optimized(4, ports=2, hosts_per_leaf=2, spines=2)
    failed = topo.with_failures(["h0.g0.p0:leaf.p0.b0.r0"])
    p = plan(failed, [Job("a", (0, 1, 2, 3), tp=8)])
    times = phase_times(p.routing(), p.traffic.nbytes, p.traffic.job, failed.capacity_bytes())
    assert np.isfinite(times[0])
