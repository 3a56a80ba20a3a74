"""Which members of a verified exchange may commit, and who is named for a silent corruption.

Every member of an exchange fingerprints what it sent and what it received
(:mod:`unbroken.comm.fingerprint`); :mod:`unbroken.train.step.sdc_check` gathers them. The backend
hands every member the same bytes of the sum (a reduce-scatter then an all-gather: each chunk is
added up once and copied to all), so correct results agree bit for bit, whatever order the
additions ran in; any difference is a corruption, never noise. The rules, as plain functions:

- every result agrees: every member commits;
- a strict majority agrees on one result: its members commit, the others are named and do not
  commit (they fall behind, and catch up from a healthy peer in the next step);
- no strict majority (two members that differ, or a three-way split): nobody commits, nobody
  is named yet, and the step is redone with the same gradients (a re-run). When the re-run's
  results agree, had the same members and every member sent the same bytes as the first time
  (same input fingerprints), a deterministic sum of the same inputs gives the same result, so
  the members whose first result differs from the re-run's are named.

Weight fingerprints (every N steps, of each member's parameters and optimizer state before the
optimizer steps) follow the same majority rule; with no majority (two replicas) the divergence
is reported without a culprit: nothing tells the healthy copy from the corrupted one.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Prints:
    """One member's fingerprints of one exchange attempt.

    Attributes:
        input: of the bytes it sent (0: it sent zeros, catching up).
        result: of the sum it received.
        weights: of its parameters and optimizer state; None when not checked this step.
    """

    input: int
    result: int
    weights: int | None = None


@dataclasses.dataclass(frozen=True)
class Attempt:
    """What a step's attempt left to name a culprit by once a re-run agrees."""

    step: int
    layout: tuple[int, ...]  # the sizes of the buffers exchanged, in order
    prints: Mapping[int, Prints]  # replica id -> its fingerprints


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What one member concludes from every member's fingerprints.

    Attributes:
        commit: whether this member may commit the step.
        results_differ: the members' results are not all the same.
        weights_differ: the members' weights are not all the same (when checked).
        culprits: the replicas named as corrupted (results or weights).
        unresolved: results differ with no majority: a re-run decides.
        named_by_rerun: the culprits were named by comparing a re-run with the first attempt.
    """

    commit: bool
    results_differ: bool = False
    weights_differ: bool = False
    culprits: tuple[int, ...] = ()
    unresolved: bool = False
    named_by_rerun: bool = False

    @property
    def detected(self) -> bool:
        return self.results_differ or self.weights_differ


def majority(values: Mapping[int, int]) -> int | None:
    """The value more than half of ``values`` hold, or None."""
    if not values:
        return None
    value, count = collections.Counter(values.values()).most_common(1)[0]
    return value if 2 * count > len(values) else None


def _odd_ones(values: Mapping[int, int], agreed: int) -> tuple[int, ...]:
    return tuple(sorted(r for r, v in values.items() if v != agreed))


def named_by_rerun(
    previous: Attempt | None, step: int, layout: tuple[int, ...], now: Mapping[int, Prints]
) -> tuple[int, ...]:
    """The replicas whose result in ``previous`` differs from the result every member agrees on
    now, provided the re-run summed the same inputs (same step, layout, members and input
    fingerprints); () when it cannot say."""
    if previous is None or previous.step != step or previous.layout != layout:
        return ()
    if set(previous.prints) != set(now):
        return ()
    if any(previous.prints[r].input != p.input for r, p in now.items()):
        return ()
    results = {p.result for p in now.values()}
    if len(results) != 1:
        return ()
    agreed = results.pop()
    return _odd_ones({r: p.result for r, p in previous.prints.items()}, agreed)


def judge(
    prints: Mapping[int, Prints], me: int, layout: tuple[int, ...] = (), previous: Attempt | None = None, step: int = 0
) -> Judgement:
    """What replica ``me`` concludes from ``prints`` (replica id -> fingerprints, every member).

    ``previous``: this step's last attempt whose results differed without a majority, if any;
    ``layout`` and ``step`` place this attempt beside it (see :func:`named_by_rerun`).

    Weights are compared among the members that fingerprinted them (not one catching up).

    Raises:
        ValueError: ``me`` has no fingerprints.
    """
    if me not in prints:
        raise ValueError(f"replica {me} is not among the fingerprinted members {sorted(prints)}")
    results = {r: p.result for r, p in prints.items()}
    culprits: set[int] = set()
    commit = True
    unresolved = False
    rerun: tuple[int, ...] = ()
    results_differ = len(set(results.values())) > 1
    if results_differ:
        agreed = majority(results)
        if agreed is None:
            commit, unresolved = False, True
        else:
            culprits.update(_odd_ones(results, agreed))
            commit = results[me] == agreed
    else:
        rerun = named_by_rerun(previous, step, layout, prints)
        culprits.update(rerun)
    weights = {r: p.weights for r, p in prints.items() if p.weights is not None}
    weights_differ = len(set(weights.values())) > 1
    if weights_differ:
        agreed_w = majority(weights)
        if agreed_w is not None:
            culprits.update(_odd_ones(weights, agreed_w))
            commit = commit and weights.get(me, agreed_w) == agreed_w
    return Judgement(
        commit=commit,
        results_differ=results_differ,
        weights_differ=weights_differ,
        culprits=tuple(sorted(culprits)),
        unresolved=unresolved,
        named_by_rerun=bool(rerun),
    )
