"""Thresholds from measured distributions: the pure half of ``bench diagnosis``'s calibration.

A rule turns a score into a verdict when the score passes a threshold and holds there for a
number of new collectives. Chosen by hand, a threshold is a guess at how noisy a healthy job
is; here it is read off two measured distributions instead:

- *healthy*: the rule's score at every new collective of clean runs (every replica or link,
  on a shared, loaded machine, with and without a CPU hog, ring and backend exchanges),
  taken as the rule sees it, *held*: the lowest score over the ``confirm`` newest collectives,
  since a verdict needs the score past the threshold at each of them;
- *faulty*: the culprit's best held score in each run of the fault the rule exists for.

:func:`separating_threshold` puts the threshold at the geometric middle of the worst healthy
score and the weakest fault's score: as far, in ratio, from the noise as from the fault. When
the two overlap it returns None: no threshold separates them, and a rule that must be right or
silent should then stay silent (or need more evidence: a longer hold, a wider window).

Scores are oriented so that higher is more faulty; a rule whose score falls with the fault (the
straggler's relative score, 1.0 healthy, 0.5 a 2x straggler) is passed as its reciprocal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from unbroken.diagnosis.robust import quantile_of


def held(scores: Sequence[float], confirm: int) -> list[float]:
    """The lowest score of each ``confirm`` consecutive ones: what must pass a threshold held
    over ``confirm`` collectives (empty when there are fewer)."""
    if confirm < 1:
        raise ValueError(f"confirm must be >= 1, got {confirm}")
    return [min(scores[i : i + confirm]) for i in range(len(scores) - confirm + 1)]


def separating_threshold(healthy: Sequence[float], faulty: Sequence[float]) -> float | None:
    """The geometric middle of the worst healthy score and the weakest fault's, or None when
    the fault's does not exceed every healthy one (or either side is empty or not positive)."""
    if not healthy or not faulty:
        return None
    worst, weakest = max(healthy), min(faulty)
    if worst <= 0 or weakest <= worst:
        return None
    return math.sqrt(worst * weakest)


def describe(xs: Sequence[float]) -> dict[str, Any]:
    """n, p50, p99 and max of a score distribution (rounded), for the bench's JSON and the page."""
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {
        "n": len(xs),
        "p50": round(quantile_of(xs, 0.5), 4),
        "p99": round(quantile_of(xs, 0.99), 4),
        "max": round(max(xs), 4),
    }


def calibration(healthy: Sequence[float], faulty: Sequence[float], configured: float) -> dict[str, Any]:
    """One rule's calibration: both distributions, the threshold they give, the one in use,
    and the margins of the one in use (over the worst healthy score, under the weakest fault)."""
    derived = separating_threshold(healthy, faulty)
    return {
        "healthy": describe(healthy),
        "faulty": describe(faulty),
        "derived_threshold": round(derived, 4) if derived is not None else None,
        "configured_threshold": configured,
        "margin_over_healthy": round(configured / max(healthy), 3) if healthy and max(healthy) > 0 else None,
        "margin_under_fault": round(min(faulty) / configured, 3) if faulty and configured > 0 else None,
    }
