"""The Monte Carlo simulation agrees with the closed form within its confidence interval."""

from __future__ import annotations

import pytest

from unbroken.sim.model import Cluster, Policy, closed_form
from unbroken.sim.montecarlo import simulate

SYNC_CASES = [
    (Cluster.from_job_mtbf(100_000, 18 * 60), Policy("s", False, {"restart": 600.0}, checkpoint_interval_s=10.0)),
    (Cluster.from_job_mtbf(16_384, 3 * 3600), Policy("s", False, {"restart": 600.0}, checkpoint_stall_s=30.0)),
    (
        Cluster.from_job_mtbf(8192, 2 * 3600, spare_nodes=2, repair_h=3.0),
        Policy("s", False, {"detect": 60.0, "restart": 300.0}, checkpoint_interval_s=1800.0, checkpoint_stall_s=20.0),
    ),
]


@pytest.mark.parametrize(("cluster", "policy"), SYNC_CASES)
def test_synchronous_closed_form_lies_in_the_confidence_interval(cluster: Cluster, policy: Policy) -> None:
    sim = simulate(cluster, policy, years=0.5, runs=12, seed=1)
    estimate = closed_form(cluster, policy)
    assert abs(sim.ettr - estimate.ettr) <= sim.ci95
    for key in ("lost_work", "checkpoint_stall"):
        assert sim.lost[key] == pytest.approx(estimate.lost[key], abs=3 * sim.ci95 + 1e-4)


def test_replica_level_closed_form_lies_in_the_confidence_interval() -> None:
    # Rare overlaps: the independence approximation of the closed form holds.
    cluster = Cluster.from_job_mtbf(16_384, 3 * 3600, replicas=8)
    policy = Policy("ft", True, {"stall": 120.0}, {"restart": 600.0}, rejoin_stall_s=5.0)
    sim = simulate(cluster, policy, years=1.0, runs=12, seed=2)
    assert abs(sim.ettr - closed_form(cluster, policy).ettr) <= sim.ci95


def test_breakdown_and_ettr_account_for_all_time() -> None:
    cluster = Cluster.from_job_mtbf(100_000, 18 * 60, replicas=12, min_replicas=11, spare_nodes=1, repair_h=1.0)
    policy = Policy(
        "ft",
        True,
        {"stall": 180.0},
        {"restart": 420.0},
        checkpoint_stall_s=1.0,
        checkpoint_interval_s=600.0,
        steady_overhead=0.01,
    )
    sim = simulate(cluster, policy, years=0.2, runs=3, seed=3)
    assert sim.ettr + sum(sim.lost.values()) == pytest.approx(1.0, abs=1e-9)
    assert sim.lost["quorum_loss"] > 0 and sim.lost["spare_wait"] > 0


def test_spare_exhaustion_costs_goodput() -> None:
    policy = Policy("ft", True, {"stall": 180.0}, {"restart": 420.0})
    plenty = Cluster.from_job_mtbf(100_000, 18 * 60, replicas=12)
    scarce = Cluster.from_job_mtbf(100_000, 18 * 60, replicas=12, spare_nodes=2, repair_h=2.0)
    assert simulate(scarce, policy, years=0.2, runs=3).ettr < simulate(plenty, policy, years=0.2, runs=3).ettr - 0.01


def test_same_seed_same_answer_and_bad_arguments() -> None:
    cluster = Cluster.from_job_mtbf(1024, 3600)
    policy = Policy("s", False, {"restart": 60.0})
    assert (
        simulate(cluster, policy, years=0.1, runs=2, seed=7).ettr
        == simulate(cluster, policy, years=0.1, runs=2, seed=7).ettr
    )
    with pytest.raises(ValueError, match="runs must be at least 2"):
        simulate(cluster, policy, runs=1)
    with pytest.raises(ValueError, match="years must be greater than 0"):
        simulate(cluster, policy, years=-1.0)
