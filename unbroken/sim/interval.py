"""How often to checkpoint: Young's and Daly's formulas, and the optimum of the model itself.

Young and Daly assume that every failure rolls the job back to its last checkpoint, so they only
apply to the synchronous policy; replica-level policies redo one step, and their checkpoint
interval only trades the checkpoint stall against how much a total loss would cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import minimize_scalar

from unbroken.sim.model import Cluster, Policy, closed_form, daly_interval
from unbroken.sim.montecarlo import simulate


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum (Young 1974): ``sqrt(2 * checkpoint cost * MTBF)``."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


@dataclass(frozen=True)
class IntervalChoice:
    """Checkpoint intervals in seconds (``None`` where they do not apply) and why."""

    young_s: float | None
    daly_s: float | None
    model_optimum_s: float | None
    model_optimum_ettr: float | None
    simulated_optimum_s: float | None
    simulated_optimum_ettr: float | None
    note: str


def optimal_intervals(cluster: Cluster, policy: Policy, *, simulate_grid: bool = True, seed: int = 0) -> IntervalChoice:
    """Young, Daly, the closed form's optimum, and the best of a Monte Carlo grid around it."""
    if policy.replica_level:
        return IntervalChoice(
            None,
            None,
            None,
            None,
            None,
            None,
            "replica-level recovery redoes one step, not the work since the last checkpoint: "
            "checkpoint as rarely as the cost of losing every replica allows",
        )
    lam = cluster.event_rate_per_s
    if lam == 0:
        return IntervalChoice(None, None, None, None, None, None, "no failures: checkpoints only cost")
    mtbf = 1.0 / lam
    ckpt = policy.checkpoint_stall_s
    young = max(cluster.step_s, young_interval(ckpt, mtbf))
    daly = max(cluster.step_s, daly_interval(ckpt, mtbf))

    def ettr_at(interval: float) -> float:
        return closed_form(cluster, replace(policy, checkpoint_interval_s=interval)).ettr

    if ckpt == 0:
        best, note = cluster.step_s, "checkpoints cost nothing here: every step is optimal"
    else:
        low, high = math.log(cluster.step_s), math.log(max(20 * mtbf, 2 * cluster.step_s))
        found = minimize_scalar(lambda x: -ettr_at(math.exp(x)), bounds=(low, high), method="bounded")
        best, note = float(math.exp(found.x)), "optimum of the closed form; grid of simulations around it"
    simulated_s = simulated_ettr = None
    if simulate_grid:
        grid = sorted({max(cluster.step_s, best * f) for f in (0.5, 0.71, 1.0, 1.41, 2.0)} | {young, daly})
        scores = [
            simulate(cluster, replace(policy, checkpoint_interval_s=g), years=1.0, runs=4, seed=seed).ettr for g in grid
        ]
        pick = int(np.argmax(scores))
        simulated_s, simulated_ettr = grid[pick], scores[pick]
    return IntervalChoice(young, daly, best, ettr_at(best), simulated_s, simulated_ettr, note)
