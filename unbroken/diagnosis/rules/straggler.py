"""Compute stragglers: one rank that consistently arrives last at the collectives.

Scores follow nvidia-resiliency-ext: a reference median over this rank's median of compute time
(the time between leaving one collective and entering the next, so waits are excluded).
The *relative* score compares with the median of the other ranks (nvidia-resiliency-ext uses
the fastest rank; with three ranks sharing two cores, the fastest is simply the one the
scheduler gave a core to itself, and a 1.4x gap between it and a healthy peer was measured
for tens of steps, which is noise, not a straggler); the *individual* score compares with this
rank's own best window. A score below the threshold (0.75: 1.33x slower) makes a candidate; the
rank must also have arrived last at most recent collectives, so that noise spread evenly
over all ranks (a busy machine) is not blamed on one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from unbroken.diagnosis.robust import median


@dataclasses.dataclass(frozen=True)
class StragglerFinding:
    replica: int
    relative: float
    individual: float
    last_share: float
    evidence: dict[str, Any]


def scores(compute: Mapping[int, Sequence[float]], best: Mapping[int, float]) -> dict[int, tuple[float, float]]:
    """(relative, individual) score per replica; 1.0 is healthy, lower is slower."""
    meds = {r: median(xs) for r, xs in compute.items() if xs}
    if not meds:
        return {}
    out = {}
    for r, m in meds.items():
        others = [x for q, x in meds.items() if q != r]
        reference = median(others) if others else m
        out[r] = (reference / m if m > 0 else 1.0, (best.get(r, m) / m) if m > 0 else 1.0)
    return out


def find_straggler(
    compute: Mapping[int, Sequence[float]],
    last_arrivals: Sequence[int],
    best: Mapping[int, float],
    threshold: float = 0.75,
    min_samples: int = 6,
    last_share: float = 0.6,
    always_slow: float = 0.45,
) -> StragglerFinding | None:
    """The straggling replica, if one is both slow (score < threshold) and usually last.

    Args:
        compute: recent compute times per replica (same collectives for all).
        last_arrivals: for each recent collective, which replica entered it last.
        best: each replica's best (lowest) windowed median seen so far.
        always_slow: a rank that has been this slow relative to its peers from the start
            (its individual score still healthy) is named only below this relative score.
            Three processes on two cores keep one of them 1.5x slower for a whole run; that
            is the machine, not a failing rank. A rank that *became* slow (individual score
            below ``threshold``) is named at ``threshold``.
    """
    if len(compute) < 2 or any(len(xs) < min_samples for xs in compute.values()):
        return None
    sc = scores(compute, best)
    worst = min(sc, key=lambda r: sc[r][0])
    rel, ind = sc[worst]
    share = last_arrivals.count(worst) / len(last_arrivals) if last_arrivals else 0.0
    if rel >= threshold or share < last_share:
        return None
    if ind >= threshold and rel >= always_slow:
        return None
    evidence = {
        "relative_score": round(rel, 3),
        "individual_score": round(ind, 3),
        "last_share": round(share, 2),
        "compute_median_s": {str(r): round(median(xs), 4) for r, xs in compute.items()},
        "threshold": threshold,
    }
    return StragglerFinding(worst, rel, ind, share, evidence)
