"""How much the unbroken projection moves with each of its inputs.

A projection from a handful of single-machine figures to 100,000 GPUs is only as good as the
figure it leans on most. For each input (every measured figure, and the assumed cost) this
reports the closed-form ETTR with the input halved and doubled, and for the figures that decide
a target, the largest value that still meets it: which figure to measure better, or to improve,
is then read off, not argued.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from unbroken.sim.measured import REPLICA_RESTART_S, Figure, unbroken_policy
from unbroken.sim.model import Cluster, Policy, closed_form

#: The assumed inputs (not measured by unbroken), varied beside the measured figures.
ASSUMED = {"replica_restart_s": REPLICA_RESTART_S}
#: Ratios: what is halved or doubled is their excess over 1 (a 5% overhead becomes 2.5% or 10%).
RATIOS = frozenset({"overhead_ratio", "record_overhead_ratio", "donor_slowdown"})
#: Not a cost: the size the checkpoint figures were measured at (they are scaled per GiB).
UNVARIED = frozenset({"checkpoint_size_mb"})


@dataclasses.dataclass(frozen=True)
class Swing:
    """The closed-form ETTR with one input at half and at twice its value (a ratio's excess over 1)."""

    name: str
    value: float
    kind: str  # "measured", "default" (the target, no benchmark file) or "assumed"
    ettr_half: float
    ettr_double: float

    @property
    def spread(self) -> float:
        return abs(self.ettr_half - self.ettr_double)


def _policy(cluster: Cluster, figures: dict[str, Figure], **assumed: float) -> Policy:
    return unbroken_policy(figures, cluster.step_s, cluster.gpus, **{**ASSUMED, **assumed})


def _ettr(cluster: Cluster, figures: dict[str, Figure], name: str, value: float) -> float:
    if name in ASSUMED:
        return closed_form(cluster, _policy(cluster, figures, **{name: value})).ettr
    changed = dict(figures)
    old = figures[name]
    scale = value / old.value if old.value else 0.0
    changed[name] = dataclasses.replace(old, value=value, curve=tuple((x, y * scale) for x, y in old.curve))
    return closed_form(cluster, _policy(cluster, changed)).ettr


def swings(cluster: Cluster, figures: dict[str, Figure]) -> list[Swing]:
    """Every input's swing, largest first."""
    inputs = {
        name: (fig.value, "measured" if fig.source.startswith("measured") else "default")
        for name, fig in figures.items()
    }
    inputs.update({name: (value, "assumed") for name, value in ASSUMED.items()})
    out = []
    for name, (value, kind) in inputs.items():
        if name in UNVARIED or value <= 0 or (name in RATIOS and value <= 1):
            continue
        half, double = (1 + (value - 1) / 2, 1 + (value - 1) * 2) if name in RATIOS else (value / 2, value * 2)
        out.append(Swing(name, value, kind, _ettr(cluster, figures, name, half), _ettr(cluster, figures, name, double)))
    return sorted(out, key=lambda s: s.spread, reverse=True)


def largest_meeting(
    ettr_at: Callable[[float], float], target: float, low: float, high: float, iterations: int = 60
) -> float:
    """The largest value in [low, high] at which ``ettr_at`` (falling in it) still meets
    ``target``: NaN if even ``low`` misses, ``high`` if even ``high`` meets it."""
    if ettr_at(low) < target:
        return math.nan
    if ettr_at(high) >= target:
        return high
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if ettr_at(mid) >= target else (low, mid)
    return low


def replica_restart_for(cluster: Cluster, figures: dict[str, Figure], target: float) -> float:
    """The longest replica restart (seconds) at which the projection still meets ``target``."""
    return largest_meeting(lambda v: _ettr(cluster, figures, "replica_restart_s", v), target, 0.0, 24 * 3600.0)
