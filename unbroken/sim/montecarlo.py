"""Monte Carlo simulation of the process that :mod:`unbroken.sim.model` estimates in closed form.

It draws every failure event of a horizon, serves the global stalls one after another (Lindley's
recursion, vectorised with cumulative maxima), matches replacement nodes to spares first come
first served, and integrates the job's throughput over the piecewise-constant timeline. The
closed form is checked against it, and it is the reference where the closed form approximates
(replica-level policies with many replicas out at once, bursts, spare exhaustion).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy import stats

from unbroken.sim.model import (
    CATCH_UP,
    CHECKPOINT_STALL,
    DEGRADED,
    LOST_WORK,
    QUORUM_LOSS,
    SPARE_WAIT,
    STEADY_OVERHEAD,
    Cluster,
    Policy,
    check_pair,
    effective_interval,
    throughput_by_out,
)

YEAR_S = 365.0 * 24 * 3600


@dataclass(frozen=True)
class SimResult:
    """Mean ETTR over independent runs, its 95% confidence half-width, and the breakdown."""

    ettr: float
    ci95: float
    lost: dict[str, float]
    runs: int
    years_per_run: float
    events_per_run: float
    elapsed_s: float


def simulate(
    cluster: Cluster,
    policy: Policy,
    *,
    years: float = 1.0,
    runs: int = 20,
    seed: int = 0,
) -> SimResult:
    """Simulates ``runs`` independent horizons of ``years`` each.

    Raises:
        ValueError: on a non-positive horizon or fewer than two runs (no confidence interval).
    """
    if not math.isfinite(years) or years <= 0:
        raise ValueError(f"years must be greater than 0, got {years!r}")
    if runs < 2:
        raise ValueError(f"runs must be at least 2 to give a confidence interval, got {runs!r}")
    check_pair(cluster, policy)
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    horizon = years * YEAR_S
    results = [_one_run(cluster, policy, horizon, rng) for _ in range(runs)]
    ettrs = np.array([r[0] for r in results])
    keys = sorted({k for r in results for k in r[1]})
    lost = {k: float(np.mean([r[1].get(k, 0.0) for r in results])) for k in keys}
    half = float(stats.t.ppf(0.975, runs - 1) * ettrs.std(ddof=1) / math.sqrt(runs))
    return SimResult(
        ettr=float(ettrs.mean()),
        ci95=half,
        lost=lost,
        runs=runs,
        years_per_run=years,
        events_per_run=float(np.mean([r[2] for r in results])),
        elapsed_s=time.perf_counter() - started,
    )


def _one_run(
    cluster: Cluster, policy: Policy, horizon: float, rng: np.random.Generator
) -> tuple[float, dict[str, float], int]:
    lam = cluster.event_rate_per_s
    count = int(rng.poisson(lam * horizon))
    times = np.sort(rng.uniform(0.0, horizon, count))
    burst = rng.random(count) < cluster.burst_prob
    nodes = np.where(burst, cluster.burst_nodes, 1)
    replicas_out = np.where(burst, min(cluster.burst_nodes, cluster.replicas), 1)
    waits = _spare_waits(cluster, times, nodes)
    if policy.replica_level:
        ettr, lost = _replica_run(cluster, policy, horizon, times, replicas_out, waits)
    else:
        ettr, lost = _synchronous_run(cluster, policy, horizon, times, waits)
    return ettr, lost, count


def _spare_waits(cluster: Cluster, times: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Per event, how long its last replacement node waits for a spare."""
    if cluster.spare_nodes is None or times.size == 0:
        return np.zeros_like(times)
    demand = np.repeat(times, nodes)
    repair = cluster.repair_h * 3600.0
    spares = cluster.spare_nodes
    served = demand.copy()
    # The j-th demand takes the j-th token: P spares at time 0, then repaired nodes in order.
    served[spares:] = np.maximum(demand[spares:], demand[: demand.size - spares] + repair)
    starts = np.concatenate(([0], np.cumsum(nodes)[:-1]))
    return np.maximum.reduceat(served - demand, starts)


def _serial_queue(arrivals: np.ndarray, service: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of each job of a single server, first come first served (Lindley)."""
    total = np.cumsum(service)
    before = total - service
    end = total + np.maximum.accumulate(arrivals - before)
    return end - service, end


def _clipped(start: np.ndarray, end: np.ndarray, horizon: float) -> np.ndarray:
    return np.minimum(end, horizon) - np.minimum(start, horizon)


def _split(parts: dict[str, np.ndarray], service: np.ndarray, clipped: np.ndarray) -> dict[str, float]:
    share = np.divide(clipped, service, out=np.zeros_like(clipped), where=service > 0)
    return {key: float(np.sum(value * share)) for key, value in parts.items()}


def _synchronous_run(
    cluster: Cluster, policy: Policy, horizon: float, times: np.ndarray, waits: np.ndarray
) -> tuple[float, dict[str, float]]:
    interval = effective_interval(cluster, policy)
    ckpt = policy.checkpoint_stall_s
    period = interval + ckpt
    parts = {key: np.full(times.size, value) for key, value in policy.stall_s.items()}
    parts[SPARE_WAIT] = waits
    service = policy.stall_total_s + waits
    start, end = _serial_queue(times, service)
    previous_end = np.concatenate(([0.0], end[:-1]))
    ran = np.maximum(times - previous_end, 0.0)  # zero for failures during a stall
    tail = max(horizon - (end[-1] if end.size else 0.0), 0.0)
    done = np.floor(ran / period)
    rest = ran - done * period
    kept = float(done.sum() * interval)
    tail_done = math.floor(tail / period)
    tail_rest = tail - tail_done * period
    kept += tail_done * interval + min(tail_rest, interval)  # work at the horizon is not lost
    lost = _split(parts, service, _clipped(start, end, horizon))
    lost[LOST_WORK] = float(np.minimum(rest, interval).sum())
    lost[CHECKPOINT_STALL] = float((done * ckpt + np.maximum(rest - interval, 0.0)).sum()) + (
        tail_done * ckpt + max(tail_rest - interval, 0.0)
    )
    return _finish(policy, kept, lost, horizon)


def _replica_run(
    cluster: Cluster,
    policy: Policy,
    horizon: float,
    times: np.ndarray,
    replicas_out: np.ndarray,
    waits: np.ndarray,
) -> tuple[float, dict[str, float]]:
    interval = effective_interval(cluster, policy)
    ckpt_keep = interval / (interval + policy.checkpoint_stall_s)
    stall = policy.stall_total_s + cluster.step_s / 2
    back = times + stall + policy.degraded_total_s + waits
    n = times.size
    rejoin = policy.rejoin_stall_s * replicas_out
    has_rejoin = rejoin > 0
    arrivals = np.concatenate((times, back[has_rejoin]))
    service = np.concatenate((np.full(n, stall), rejoin[has_rejoin]))
    parts = {key: np.full(n, value) for key, value in policy.stall_s.items()}
    parts[LOST_WORK] = np.full(n, cluster.step_s / 2)
    extra = int(has_rejoin.sum())
    parts = {key: np.concatenate((value, np.zeros(extra))) for key, value in parts.items()}
    parts[CATCH_UP] = np.concatenate((np.zeros(n), rejoin[has_rejoin]))
    order = np.argsort(arrivals, kind="stable")
    arrivals, service = arrivals[order], service[order]
    parts = {key: value[order] for key, value in parts.items()}
    start, end = _serial_queue(arrivals, service)
    lost = _split(parts, service, _clipped(start, end, horizon))

    points = np.minimum(np.concatenate((times, back, start, end)), horizon)
    d_out = np.concatenate((replicas_out, -replicas_out, np.zeros(2 * start.size, dtype=int)))
    d_stall = np.concatenate((np.zeros(2 * n, dtype=int), np.ones(start.size, int), -np.ones(start.size, int)))
    order = np.argsort(points, kind="stable")
    points = np.concatenate(([0.0], points[order], [horizon]))
    out = np.concatenate(([0], np.cumsum(d_out[order])))
    stalled = np.concatenate(([0], np.cumsum(d_stall[order]))) > 0
    duration = np.diff(points)
    thr = throughput_by_out(cluster)[np.minimum(out, cluster.replicas)]
    training = duration * ~stalled
    mean_work = float(np.sum(training * thr))
    below = training * (thr == 0) * (out > 0)
    degraded = float(np.sum(training * (1 - thr))) - float(below.sum())
    # The stall part of a replica's absence is already counted as stall; the spare-wait share is
    # taken of the time it spends out after the stall.
    after_stall = float(np.sum((policy.degraded_total_s + waits) * replicas_out))
    wait_share = float(np.sum(waits * replicas_out)) / after_stall if after_stall > 0 else 0.0
    lost[DEGRADED] = degraded * (1 - wait_share)
    lost[QUORUM_LOSS] = float(below.sum()) * (1 - wait_share)
    lost[SPARE_WAIT] = (degraded + float(below.sum())) * wait_share
    lost[CHECKPOINT_STALL] = mean_work * (1 - ckpt_keep)
    return _finish(policy, mean_work * ckpt_keep, lost, horizon)


def _finish(policy: Policy, kept: float, lost: dict[str, float], horizon: float) -> tuple[float, dict[str, float]]:
    keep = 1.0 / (1.0 + policy.steady_overhead)
    lost[STEADY_OVERHEAD] = kept * (1 - keep)
    fractions = {key: value / horizon for key, value in lost.items()}
    return kept * keep / horizon, fractions
