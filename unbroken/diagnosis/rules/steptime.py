"""Step-time change: one replica whose compute got slower, alone among its peers.

The evidence the verdict needs (``metric_anomaly`` / ``step_time_change``), all measured on the
replica's compute times at one collective group (the time between leaving one collective and
entering the next, less its run-queue wait), a recent window of ``w`` collectives against the
baseline before it (at least ``min_history``):

- **the whole distribution moved**: :func:`shift_score` is the smaller of the recent median over
  the baseline median and the recent fastest quarter over the baseline's. A CPU hog sharing
  the cores makes a replica's steps bursty (some slow, some as fast as ever: the median moves,
  the fastest quarter does not); a degraded rank is slower at every step;
- **alone**: every peer's median ratio stays within ``PEER_BAND`` (a change shared by every
  replica is the machine; one replica slowing while another speeds up is processes trading
  places on shared cores);
- **the job's pace moved** (:func:`pace_moved`): the collectives came slower by at least half
  the extra compute (otherwise the replica's waits shrank by as much: it left the exchange
  earlier, the job is as fast as ever);
- held over ``confirm`` new collectives, at or above the threshold.

:func:`gated_score` is the shift score where the replica is alone and the pace moved, else 0.0:
the score the threshold is set against. Its threshold (:data:`STEP_TIME_THRESHOLD`, the default of
``MasterSettings.step_time_threshold``) was derived from measured distributions with
:mod:`unbroken.diagnosis.rules.calibrate`: the figures are at the constant. It sits above the straggler
threshold (1.39x): a replica slowed that much and last at most collectives is named a straggler
first, so this verdict is left for a large slowdown that the straggler rule does not see.

A wrong verdict costs the policy's action for ``step_time_change``: ``none`` by default (an
event and a log line; the supervisor does nothing), ``isolate`` when an operator asks for it,
which moves a healthy replica to a spare slot (a restart and a catch-up).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from unbroken.diagnosis.robust import median, quantile_of

# Measured with ``bench diagnosis`` (docs/benchmarks/2026-11-29-diagnosis-thresholds.md), held over
# 3 collectives: every replica at every collective of 8 clean runs on 2 shared cores at load 6-9
# (ring and backend, a CPU hog, a 50 ms pace; 8,828 scores) peaked at 1.074 (p99 1.043); one
# earlier clean run at load 11 reached at least 1.15 (the old rule named it: median 1.265,
# fastest quarter >= 1.15; its score lay between 1.15 and 1.265). The bench's 1.3x throughput drop
# held 1.17, 1.85 and 2.10 in 3 runs: its weakest run lies inside that healthy range, so no
# threshold is sure to separate the two (calibrate.separating_threshold gives None against
# 1.265) and the rule leaves a fault that weak alone (the straggler rule named all three first).
# The threshold is the geometric middle of the worst healthy score known (1.15) and the fault's
# median (1.85): 1.46, rounded down.
STEP_TIME_THRESHOLD = 1.45
PEER_BAND = (0.85, 1.1)  # peers' recent/baseline median ratios for a change to be "alone"


def median_ratio(xs: Sequence[float], w: int, min_history: int) -> float | None:
    """The recent ``w`` samples' median over the baseline's, once both windows are full."""
    if len(xs) < min_history + w:
        return None
    base = median(xs[:-w])
    return median(xs[-w:]) / base if base > 0 else None


def shift_score(xs: Sequence[float], w: int, min_history: int) -> float | None:
    """min(median ratio, fastest-quarter ratio) of the recent window over the baseline."""
    ratio = median_ratio(xs, w, min_history)
    if ratio is None:
        return None
    base = quantile_of(xs[:-w], 0.25)
    floor = quantile_of(xs[-w:], 0.25) / base if base > 0 else 0.0
    return min(ratio, floor)


def pace_moved(xs: Sequence[float], cadence: Sequence[float], w: int) -> bool:
    """Whether the collectives came slower by at least half the replica's extra compute.

    A replica that really got slower delays every collective it is last to enter. Its
    compute can also grow while its waits shrink by as much, the job as fast as ever: in
    a clean ring run, members traded the order in which they leave the exchange, and one
    replica's compute read 1.33x for a dozen collectives.
    """
    if len(xs) <= w or len(cadence) <= w:
        return True
    extra = median(xs[-w:]) - median(xs[:-w])
    return median(cadence[-w:]) - median(cadence[:-w]) >= 0.5 * extra


def gated_score(
    replica: int,
    compute: Mapping[int, Sequence[float]],
    cadence: Sequence[float],
    w: int,
    min_history: int,
    ratios: Mapping[int, float | None] | None = None,
) -> float | None:
    """``replica``'s shift score when it is alone and the pace moved, 0.0 when not, None before
    its windows are full. ``compute``: each replica's compute times at one group (the same
    collectives for all); ``ratios``: their :func:`median_ratio` when already known (the master
    judges every replica of a group in turn: computed once, not once per replica)."""
    xs = compute[replica]
    score = shift_score(xs, w, min_history)
    if score is None:
        return None
    if ratios is None:
        ratios = {q: median_ratio(ys, w, min_history) for q, ys in compute.items()}
    others = [r for q, r in ratios.items() if q != replica and r is not None]
    lo, hi = PEER_BAND
    if not others or max(others) >= hi or min(others) <= lo or not pace_moved(xs, cadence, w):
        return 0.0
    return score


def straggler_coming(xs: Sequence[float], confirm: int, window: int, threshold: float) -> bool:
    """Whether the replica's latest ``confirm`` compute times are past the straggler threshold.

    The step-time change point sees a slowdown as soon as half its window is slow; the
    straggler rule, which names the class better (slow *and* last), needs one or two more
    collectives (its window's median moves a sample later) and its own confirmation. A
    change this big is left to it for that long, and no longer: a rank that is slow but
    not last still gets its step-time verdict.
    """
    if len(xs) < 2 * confirm + 1:
        return False
    base = median(xs[:-window] or xs)
    return base > 0 and median(xs[-confirm:]) * threshold >= base
