"""The closed form against hand-computed cases, and bad parameters."""

from __future__ import annotations

import math

import pytest

from unbroken.sim.interval import young_interval
from unbroken.sim.model import (
    Cluster,
    Policy,
    closed_form,
    daly_interval,
    expected_spare_wait_s,
)


def one_failure_per(mtbf_s: float, **kwargs: object) -> Cluster:
    return Cluster.from_job_mtbf(800, mtbf_s, **kwargs)  # 100 nodes


def test_job_mtbf_is_spread_over_nodes() -> None:
    cluster = one_failure_per(1000.0)
    assert cluster.nodes == 100
    assert cluster.event_rate_per_s == pytest.approx(1 / 1000.0)


def test_synchronous_matches_hand_computed_renewal_formula() -> None:
    # Failure every 1000 s, 100 s restart, checkpoint every 100 s for free:
    # share running = 1 - 100/1000; of it, kept = L*D*q/(1-q) with q = exp(-L*D).
    cluster = one_failure_per(1000.0)
    policy = Policy("sync", False, {"restart": 100.0}, checkpoint_interval_s=100.0)
    q = math.exp(-0.1)
    expected = 0.9 * 0.1 * q / (1 - q)
    estimate = closed_form(cluster, policy)
    assert estimate.ettr == pytest.approx(expected, rel=1e-9)
    assert estimate.lost["restart"] == pytest.approx(0.1)
    assert estimate.ettr + sum(estimate.lost.values()) == pytest.approx(1.0)


def test_published_ft_hsdp_arithmetic_is_the_first_order_limit() -> None:
    # (18 - 10) / 18 for a synchronous restart when checkpoints are (nearly) free and frequent.
    cluster = Cluster.from_job_mtbf(100_000, 18 * 60, step_s=0.01)
    policy = Policy("sync", False, {"restart": 600.0}, checkpoint_interval_s=0.01)
    assert closed_form(cluster, policy).ettr == pytest.approx(8 / 18, abs=1e-4)


def test_replica_level_loss_is_stall_plus_one_replica_share() -> None:
    cluster = one_failure_per(100_000.0, replicas=10, step_s=2.0)
    policy = Policy("ft", True, {"stall": 99.0}, {"restart": 400.0}, checkpoint_interval_s=1e9)
    lam = 1 / 100_000.0
    expected = (1 - lam * (99.0 + 1.0)) * (1 - lam * 400.0 / 10)
    assert closed_form(cluster, policy).ettr == pytest.approx(expected, rel=1e-6)


def test_no_failures_leaves_only_checkpoint_and_steady_costs() -> None:
    cluster = Cluster(gpus=64, node_failure_rate_per_h=0.0)
    policy = Policy(
        "sync", False, {"restart": 600.0}, checkpoint_interval_s=90.0, checkpoint_stall_s=10.0, steady_overhead=0.25
    )
    assert closed_form(cluster, policy).ettr == pytest.approx(0.9 / 1.25)


def test_saturated_restarts_mean_no_progress() -> None:
    cluster = one_failure_per(300.0)
    policy = Policy("sync", False, {"restart": 600.0})
    assert closed_form(cluster, policy).ettr == 0.0


def test_quorum_loss_when_every_replica_is_required() -> None:
    relaxed = one_failure_per(1000.0, replicas=4, min_replicas=1)
    strict = one_failure_per(1000.0, replicas=4, min_replicas=4)
    policy = Policy("ft", True, {"stall": 10.0}, {"restart": 300.0})
    loose, tight = closed_form(relaxed, policy), closed_form(strict, policy)
    assert tight.ettr < loose.ettr
    assert tight.lost["quorum_loss"] > 10 * loose.lost["quorum_loss"]


def test_spare_wait_shrinks_with_the_pool() -> None:
    waits = [expected_spare_wait_s(one_failure_per(3600.0, spare_nodes=p, repair_h=10.0)) for p in (0, 2, 5, 20)]
    assert waits[0] == pytest.approx(36_000.0)
    assert waits == sorted(waits, reverse=True)
    assert waits[-1] < 60.0
    assert expected_spare_wait_s(one_failure_per(3600.0)) == 0.0


def test_young_and_daly_hand_values() -> None:
    assert young_interval(50.0, 10_000.0) == pytest.approx(1000.0)
    ratio = 50.0 / 20_000.0
    assert daly_interval(50.0, 10_000.0) == pytest.approx(1000.0 * (1 + math.sqrt(ratio) / 3 + ratio / 9) - 50.0)
    assert daly_interval(500.0, 100.0) == 100.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"node_failure_rate_per_h": -1.0}, "must not be negative"),
        ({"node_failure_rate_per_h": math.nan}, "finite"),
        ({"replicas": 2, "min_replicas": 3}, "fewer than min_replicas"),
        ({"replicas": 0}, "replicas must be a whole number"),
        ({"burst_prob": 1.5}, "probability"),
        ({"gpus": 16, "replicas": 4}, "need at least 4 nodes"),
        ({"spare_nodes": -2}, "spare_nodes"),
        ({"repair_h": 0.0}, "greater than 0"),
    ],
)
def test_bad_cluster_parameters_are_explained(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"gpus": 800, "node_failure_rate_per_h": 1e-4}
    with pytest.raises(ValueError, match=message):
        Cluster(**{**base, **kwargs})  # type: ignore[arg-type]


def test_bad_policies_are_explained() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        Policy("p", False, {"restart": -5.0})
    with pytest.raises(ValueError, match="only applies to replica-level"):
        Policy("p", False, {"restart": 5.0}, {"restart": 5.0})
    with pytest.raises(ValueError, match="greater than 0"):
        Policy("p", False, {"restart": 5.0}, checkpoint_interval_s=0.0)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        closed_form(one_failure_per(1000.0), Policy("ft", True, {"stall": 5.0}))
