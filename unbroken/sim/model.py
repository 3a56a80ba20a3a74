"""Cluster and policy parameters, and the closed-form goodput estimate.

The model, shared with the Monte Carlo simulation (:mod:`unbroken.sim.montecarlo`):

* Failure *events* arrive as a Poisson process over wall-clock time. Node failures happen at
  ``node_failure_rate_per_h`` per node; with probability ``burst_prob`` an event is a correlated
  burst taking ``burst_nodes`` nodes at once (a rack, a switch), otherwise one node.
* Every event causes a *global stall* (the whole job idle: detection, reconfiguration, for the
  synchronous policy the full restart). Stalls are served one after another: a failure that
  arrives while the job is already stalled adds its own stall after the current one. This is the
  accounting behind the published arithmetic (FT-HSDP's ``(18 - 10) / 18``); it is pessimistic
  when a real restart would absorb a second failure, and it makes the job stop making progress
  altogether once failures arrive faster than restarts finish (``ettr = 0``).
* Synchronous policy: after the stall the job resumes from its last checkpoint, so the work since
  then is redone. Checkpoints are taken every ``checkpoint_interval_s`` of training and block for
  ``checkpoint_stall_s``.
* Replica-level policies (FT-HSDP, unbroken): the survivors drop the failed replica after the
  stall and train with fewer replicas while it restarts (``degraded_s``); the job's throughput is
  ``(n - out) / n`` and zero when fewer than ``min_replicas`` remain. Survivors redo only the
  in-flight step. A returning replica may stall the others for ``rejoin_stall_s`` (catch-up).
* Spare nodes: each failed node is replaced from a pool of ``spare_nodes`` and goes to repair for
  ``repair_h`` (deterministic), after which it returns to the pool. A failure that finds the pool
  empty waits for the next repaired node, first come first served.

The synchronous estimate is exact for that process (renewal-reward argument); the replica-level
estimate treats the stall and the number of replicas out as independent. That is exact to first
order in the failure rate; when stalls are frequent it overstates the degraded loss a little,
because a replica's absence tends to overlap the stalls around its own failure (at the FT-HSDP
setting, 100K GPUs and a failure every 18 minutes, by about 0.25 points of ETTR). The Monte Carlo
simulation carries no such approximation, and both figures are reported side by side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

HOUR = 3600.0

#: Lost-time categories that are not policy-specific stall components.
LOST_WORK = "lost_work"
CHECKPOINT_STALL = "checkpoint_stall"
DEGRADED = "degraded"
QUORUM_LOSS = "quorum_loss"
CATCH_UP = "catch_up"
SPARE_WAIT = "spare_wait"
STEADY_OVERHEAD = "steady_overhead"


def _check_number(name: str, value: float, *, positive: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be greater than 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """The job's hardware and how it fails.

    Attributes:
        gpus: GPUs in the job.
        node_failure_rate_per_h: failures per node-hour (Poisson); see :meth:`from_job_mtbf`.
        gpus_per_node: GPUs per node (a node is the unit that fails and is replaced).
        replicas: data-parallel replicas (the fault domain of replica-level policies).
        min_replicas: fewest replicas the job trains with; below it the job waits.
        spare_nodes: size of the spare pool; ``None`` means replacements never run out.
        repair_h: hours a failed node spends in repair before it rejoins the spare pool.
        burst_prob: share of failure events that are correlated bursts.
        burst_nodes: nodes a burst takes down (each in a different replica, the worst case).
        step_s: training step time; the in-flight step is what replica-level policies redo.
    """

    gpus: int
    node_failure_rate_per_h: float
    gpus_per_node: int = 8
    replicas: int = 1
    min_replicas: int = 1
    spare_nodes: int | None = None
    repair_h: float = 24.0
    burst_prob: float = 0.0
    burst_nodes: int = 1
    step_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "replicas", "min_replicas", "burst_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        _check_number("node_failure_rate_per_h", self.node_failure_rate_per_h)
        _check_number("repair_h", self.repair_h, positive=True)
        _check_number("step_s", self.step_s, positive=True)
        _check_number("burst_prob", self.burst_prob)
        if self.burst_prob > 1:
            raise ValueError(f"burst_prob is a probability in [0, 1], got {self.burst_prob!r}")
        if self.spare_nodes is not None and (not isinstance(self.spare_nodes, int) or self.spare_nodes < 0):
            raise ValueError(f"spare_nodes must be None or a whole number >= 0, got {self.spare_nodes!r}")
        if self.replicas < self.min_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) is fewer than min_replicas ({self.min_replicas}): "
                "the job could never train; lower min_replicas or add replicas"
            )
        if self.nodes < self.replicas:
            raise ValueError(
                f"{self.replicas} replicas need at least {self.replicas} nodes, but {self.gpus} GPUs "
                f"at {self.gpus_per_node} per node make {self.nodes}"
            )

    @classmethod
    def from_job_mtbf(cls, gpus: int, mtbf_s: float, **kwargs: object) -> Cluster:
        """Builds a cluster whose whole job sees one failure every ``mtbf_s`` on average.

        Published figures are usually job-level ("a failure every 18 minutes at 100K GPUs"); the
        model works per node so that the rate scales with cluster size.
        """
        _check_number("mtbf_s", mtbf_s, positive=True)
        gpn = int(kwargs.get("gpus_per_node", 8))  # type: ignore[call-overload]
        nodes = math.ceil(gpus / gpn)
        return cls(gpus=gpus, node_failure_rate_per_h=HOUR / (mtbf_s * nodes), **kwargs)  # type: ignore[arg-type]

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def nodes_per_event(self) -> float:
        return 1.0 + self.burst_prob * (self.burst_nodes - 1)

    @property
    def event_rate_per_s(self) -> float:
        """Failure events per second for the whole job."""
        return self.nodes * self.node_failure_rate_per_h / HOUR / self.nodes_per_event

    @property
    def replicas_per_event(self) -> float:
        return 1.0 + self.burst_prob * (min(self.burst_nodes, self.replicas) - 1)

    def with_gpus(self, gpus: int) -> Cluster:
        """The same cluster at another size: per-node failure rate and replica count kept."""
        from dataclasses import replace

        return replace(self, gpus=gpus)


@dataclass(frozen=True)
class Policy:
    """How a job reacts to a failure; every time is seconds per failure event.

    Attributes:
        name: label in tables and JSON.
        replica_level: True for FT-HSDP-style recovery (drop the failed replica, keep training).
        stall_s: named components of the global stall (everyone idle), e.g. detection, restart.
        degraded_s: named components of the time a failed replica is out after the stall.
        rejoin_stall_s: survivors' stall when a replica rejoins (catch-up cost).
        checkpoint_interval_s: training time between checkpoints; ``None`` picks Daly's optimum.
        checkpoint_stall_s: time one checkpoint blocks training.
        steady_overhead: fractional step-time overhead with no failure (0.02 = 2% slower).
        notes: where the figures come from.
    """

    name: str
    replica_level: bool
    stall_s: Mapping[str, float]
    degraded_s: Mapping[str, float] = field(default_factory=dict)
    rejoin_stall_s: float = 0.0
    checkpoint_interval_s: float | None = None
    checkpoint_stall_s: float = 0.0
    steady_overhead: float = 0.0
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for label, parts in (("stall_s", self.stall_s), ("degraded_s", self.degraded_s)):
            for key, value in parts.items():
                _check_number(f"{self.name}: {label}[{key!r}]", value)
        if self.degraded_s and not self.replica_level:
            raise ValueError(
                f"{self.name}: degraded_s only applies to replica-level policies; a synchronous "
                "job stops entirely, so put those times in stall_s"
            )
        _check_number(f"{self.name}: rejoin_stall_s", self.rejoin_stall_s)
        _check_number(f"{self.name}: checkpoint_stall_s", self.checkpoint_stall_s)
        _check_number(f"{self.name}: steady_overhead", self.steady_overhead)
        if self.checkpoint_interval_s is not None:
            _check_number(f"{self.name}: checkpoint_interval_s", self.checkpoint_interval_s, positive=True)

    @property
    def stall_total_s(self) -> float:
        return float(sum(self.stall_s.values()))

    @property
    def degraded_total_s(self) -> float:
        return float(sum(self.degraded_s.values()))


@dataclass(frozen=True)
class Estimate:
    """ETTR and where the rest of the wall-clock time goes (fractions that sum to 1)."""

    ettr: float
    lost: dict[str, float]
    checkpoint_interval_s: float
    events_per_day: float


def check_pair(cluster: Cluster, policy: Policy) -> None:
    """Rejects combinations the model cannot represent, saying what to change."""
    if policy.replica_level and cluster.replicas < 2:
        raise ValueError(
            f"{policy.name} is a replica-level policy and needs at least 2 replicas; "
            f"the cluster has {cluster.replicas}"
        )


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval (Daly 2006, FGCS 22(3)).

    Falls back to the MTBF when a checkpoint costs more than two MTBFs, as Daly prescribes.
    """
    if checkpoint_s <= 0:
        return 0.0
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s


def effective_interval(cluster: Cluster, policy: Policy) -> float:
    """The checkpoint interval the policy runs with (Daly's optimum when it leaves it open)."""
    if policy.checkpoint_interval_s is not None:
        return policy.checkpoint_interval_s
    mtbf = 1.0 / cluster.event_rate_per_s if cluster.event_rate_per_s > 0 else math.inf
    if not math.isfinite(mtbf):
        return 24 * HOUR
    return max(cluster.step_s, daly_interval(policy.checkpoint_stall_s, mtbf))


def expected_spare_wait_s(cluster: Cluster) -> float:
    """Mean wait of one replacement node for a spare (FIFO pool, deterministic repair).

    With node demands a Poisson process of rate r, the j-th demand is served at
    ``max(d_j, d_{j-P} + repair)``; ``d_j - d_{j-P}`` is Gamma(P, r), so the wait is
    ``E[(repair - G)^+] = repair * F_P(repair) - (P / r) * F_{P+1}(repair)`` with Erlang CDFs.
    Exact for single-node failures; bursts make demands clump, which this ignores.
    """
    if cluster.spare_nodes is None:
        return 0.0
    rate = cluster.nodes * cluster.node_failure_rate_per_h / HOUR
    repair = cluster.repair_h * HOUR
    spares = cluster.spare_nodes
    if rate == 0:
        return 0.0
    if spares == 0:
        return repair
    first = stats.gamma.cdf(repair, a=spares, scale=1 / rate)
    second = stats.gamma.cdf(repair, a=spares + 1, scale=1 / rate)
    return float(max(0.0, repair * first - spares / rate * second))


def throughput_by_out(cluster: Cluster) -> np.ndarray:
    """Relative throughput with k replicas out, k = 0..replicas (0 below ``min_replicas``)."""
    n = cluster.replicas
    alive = n - np.arange(n + 1)
    return np.where(alive >= cluster.min_replicas, alive / n, 0.0)


def closed_form(cluster: Cluster, policy: Policy) -> Estimate:
    """Expected ETTR and lost-time breakdown of ``policy`` on ``cluster``."""
    check_pair(cluster, policy)
    lam = cluster.event_rate_per_s
    interval = effective_interval(cluster, policy)
    period = interval + policy.checkpoint_stall_s
    wait = expected_spare_wait_s(cluster)
    overhead_keep = 1.0 / (1.0 + policy.steady_overhead)
    lost: dict[str, float] = {}

    if not policy.replica_level:
        stall_parts = dict(policy.stall_s)
        stall_parts[SPARE_WAIT] = wait
        rho = lam * sum(stall_parts.values())
        if rho >= 1:
            return _saturated(stall_parts, interval, lam)
        if lam == 0:
            kept, run_stall = interval / period, policy.checkpoint_stall_s / period
        else:
            q = math.exp(-lam * period)
            kept = lam * interval * q / -math.expm1(-lam * period)
            run_stall = (math.exp(-lam * interval) - q) / -math.expm1(-lam * period)
        running = 1.0 - rho
        for key, value in stall_parts.items():
            lost[key] = lam * value
        lost[LOST_WORK] = running * max(0.0, 1.0 - kept - run_stall)
        lost[CHECKPOINT_STALL] = running * run_stall
        useful = running * kept
    else:
        stall_parts = dict(policy.stall_s)
        stall_parts[LOST_WORK] = cluster.step_s / 2
        rejoin = cluster.replicas_per_event * policy.rejoin_stall_s
        rho = lam * (sum(stall_parts.values()) + rejoin)
        if rho >= 1:
            return _saturated({**stall_parts, CATCH_UP: rejoin}, interval, lam)
        out_after_stall = policy.degraded_total_s + wait
        mean_out = lam * cluster.replicas_per_event * out_after_stall
        ks = np.arange(cluster.replicas + 1)
        pmf = stats.poisson.pmf(ks, mean_out)
        pmf[-1] += stats.poisson.sf(cluster.replicas, mean_out)
        thr = throughput_by_out(cluster)
        mean_thr = float(pmf @ thr)
        running = 1.0 - rho
        for key, value in stall_parts.items():
            lost[key] = lam * value
        lost[CATCH_UP] = lam * rejoin
        quorum = float(pmf[thr == 0].sum()) if (thr == 0).any() else 0.0
        spare_share = wait / out_after_stall if out_after_stall > 0 else 0.0
        degraded_loss = running * (1.0 - mean_thr - quorum)
        lost[DEGRADED] = degraded_loss * (1 - spare_share)
        lost[QUORUM_LOSS] = running * quorum * (1 - spare_share)
        lost[SPARE_WAIT] = (degraded_loss + running * quorum) * spare_share
        ckpt_keep = interval / period
        lost[CHECKPOINT_STALL] = running * mean_thr * (1 - ckpt_keep)
        useful = running * mean_thr * ckpt_keep

    lost[STEADY_OVERHEAD] = useful * (1 - overhead_keep)
    ettr = useful * overhead_keep
    return Estimate(ettr=ettr, lost=lost, checkpoint_interval_s=interval, events_per_day=lam * 24 * HOUR)


def _saturated(stall_parts: dict[str, float], interval: float, lam: float) -> Estimate:
    """Failures outpace recoveries: the job is always stalled and never trains."""
    total = sum(stall_parts.values()) or 1.0
    lost = {key: value / total for key, value in stall_parts.items()}
    return Estimate(ettr=0.0, lost=lost, checkpoint_interval_s=interval, events_per_day=lam * 24 * HOUR)
