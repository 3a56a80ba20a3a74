"""Step grants: a fast answer that stands for the next few steps, answered by the node's relay.

On the fast path (same members, next step) the coordinator's answer is known before it is
asked; still every replica asked it every step, and at 12,500 nodes of 1 s steps those requests
were more than its one core could read (1.3 cores of node lines:
docs/benchmarks/2026-11-27-coordinator-per-node.md). So a fast answer to a node's ranks may
carry ``through``: the same epoch stands for them up to that step, and the node's relay
(:mod:`unbroken.launch.node.relay`) answers their requests for the steps up to it itself, without
a line to the coordinator. The coordinator then hears a node's request once every few steps.

Why it is safe: the coordinator fixes the membership of every step it granted (a newcomer is
admitted only after the newest step granted, :attr:`~unbroken.control.quorum.rules.QuorumState.granted_through`,
and no grant goes further while one waits), exactly as the first fast answer of a step already
fixed that step's membership. Anything else that happens still reaches the coordinator: an
exchange that fails is reported with ``failed_epoch`` (never answered by a relay), and an abort
or a pushed epoch ends the grant at the relay. A relay that answers a step just before the
abort reaches it sends its rank into an exchange that fails, as a rank that asked a moment
earlier would have been.

How far: just far enough that the coordinator hears at most ``max_asks_per_s`` requests a
second (:func:`grant_steps`): a job of 2,000 groups at 1 s steps gets no grants (every answer
as before), one of 12,500 groups about 7 steps. Each replica's grants end at steps of its own
phase (:func:`grant_through`), so the requests of a step spread over the replicas instead of
all arriving every seventh step. The price, stated: a newcomer waits up to the grant's steps
longer to be admitted (at most ``max_grant_s``).
"""

from __future__ import annotations

import math

#: The most steps one grant covers, whatever the size: a newcomer waits no longer than this.
MAX_GRANT_STEPS = 64
#: The step clock's reading may run this much of a step over ``max_grant_s`` before a grant loses
#: a step. 2 s steps under a 10 s bound sat on the edge: a clock read at 2.02 s in a busy minute cut
#: grants from 5 steps to 4, and a quarter more requests reached the coordinator (its quorum p99
#: 25 to 34 ms instead of 2 to 3 ms at 12,500 nodes: docs/benchmarks/2026-11-28-rendezvous.md).
CLOCK_SLACK_STEPS = 0.1


def grant_steps(replicas: int, step_s: float | None, max_asks_per_s: float, max_grant_s: float) -> int:
    """How many steps a fast answer stands for: 1 (no grant) while ``replicas`` asking every
    ``step_s`` stay within ``max_asks_per_s``; more, up to ``max_grant_s`` of steps and
    :data:`MAX_GRANT_STEPS`, when they would not.

    Args:
        replicas: replicas asking (the members of the current epoch).
        step_s: the job's step time as the coordinator measures it; None: not known yet.
        max_asks_per_s: quorum requests a second the coordinator spends on at most.
        max_grant_s: the longest a grant may stand, in seconds (a tenth of a step more, as the
            step clock reads it: :data:`CLOCK_SLACK_STEPS`).
    """
    if step_s is None or not step_s > 0 or replicas <= 0 or not max_asks_per_s > 0:
        return 1
    wanted = math.ceil(replicas / (max_asks_per_s * step_s))
    allowed = max(1, math.floor(max_grant_s / step_s + CLOCK_SLACK_STEPS))
    return max(1, min(wanted, allowed, MAX_GRANT_STEPS))


def grant_through(replica: int, step: int, steps: int) -> int:
    """The last step the answer to ``replica``'s request for ``step`` stands for, given
    :func:`grant_steps` ``steps``: the step before ``replica``'s next asking step, one of the
    steps ``t`` with ``(t + replica) % steps == 0`` (its phase), at most ``steps - 1`` past ``step``.

    So in a steady run each replica asks once every ``steps`` steps, and in each step about one
    replica in ``steps`` asks (the phases spread them); ``steps`` of 1 is no grant (``step``).
    """
    if steps <= 1:
        return step
    return step + (-(step + 1 + replica)) % steps


class StepClock:
    """The job's step time as the coordinator sees it: from the steps its members reach over time.

    Measured here rather than taken from what replicas report (``step_time`` in a request is
    optional and a replica's own say); it keeps working under grants, since some replica asks
    at every step.
    """

    def __init__(self, window: int = 16) -> None:
        self.window = window
        self._seen: list[tuple[float, int]] = []

    def progressed(self, now: float, step: int) -> None:
        """A member asked for ``step``, past its epoch's step (a step lower than the clock's
        newest: the job went back, to a checkpoint of a rollback, and the clock starts again)."""
        if self._seen and step <= self._seen[-1][1]:
            if step == self._seen[-1][1]:
                return
            self._seen.clear()
        self._seen.append((now, step))
        if len(self._seen) > self.window:
            del self._seen[0]

    def step_s(self) -> float | None:
        """Seconds per step over the window, or None until it spans 4 steps."""
        if len(self._seen) < 2:
            return None
        (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
        if s1 - s0 < 4 or t1 <= t0:
            return None
        return (t1 - t0) / (s1 - s0)


class Grant:
    """What a node's relay holds for one rank: the epoch whose fast answer stands through a step.

    Made from a short answer that carries ``through`` (:meth:`from_answer`); asked of each of the
    rank's requests (:meth:`answers`); dropped by its holder at anything else the coordinator says
    to the rank (a full answer, a pushed epoch, an abort, a welcome).
    """

    __slots__ = ("epoch", "step", "through")

    def __init__(self, epoch: int, step: int, through: int) -> None:
        self.epoch, self.step, self.through = epoch, step, through

    @classmethod
    def from_answer(cls, epoch: int, step: int, through: int | None) -> Grant | None:
        return cls(epoch, step, through) if through is not None and through > step else None

    def answers(self, step: int, failed_epoch: int | None) -> bool:
        """Whether a request for ``step`` (``failed_epoch``: the exchange it says failed) is
        answered by the grant: a later step within it, nothing failed. If so, it is the step
        answered now (a step is answered once: the same step asked again goes to the coordinator)."""
        if failed_epoch is not None or not self.step < step <= self.through:
            return False
        self.step = step
        return True
