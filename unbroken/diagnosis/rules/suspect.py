"""Suspect hardware: a replica named for silent data corruption again within a window of steps.

One flipped bit is healed: the corrupted replica does not commit and catches up from a healthy
peer (:mod:`unbroken.train.step.sdc_check`). A second one on the same replica soon after points at its
hardware (a failing GPU or memory), which no catch-up mends: :class:`SuspectTracker` turns the
findings every rank reports (:class:`~unbroken.diagnosis.telemetry.SdcFound`, the same finding
once per member) into one :data:`~unbroken.diagnosis.verdict.SUSPECT_HARDWARE` verdict per
replica and window. Memory is bounded: a few steps per replica, and only replicas named.
"""

from __future__ import annotations

from collections import deque

from unbroken.diagnosis.verdict import SUSPECT_HARDWARE, Culprit, Verdict

DEFAULT_WINDOW_STEPS = 1000
KEPT_STEPS = 8  # distinct steps remembered per replica
MAX_REPLICAS = 4096  # replicas tracked at once (the oldest named is forgotten past it)


class SuspectTracker:
    """Counts the distinct steps at which each replica was named.

    Args:
        window_steps: two findings this many steps apart or fewer make the replica a suspect.
    """

    def __init__(self, window_steps: int = DEFAULT_WINDOW_STEPS) -> None:
        if window_steps <= 0:
            raise ValueError(f"window_steps must be > 0, got {window_steps}")
        self.window_steps = window_steps
        self._named: dict[int, deque[int]] = {}  # replica -> steps it was named at, oldest first
        self._reported: dict[int, int] = {}  # replica -> the step of its last verdict

    def observe(self, culprits: list[int], step: int, node: str | None = None) -> list[Verdict]:
        """A finding at ``step`` naming ``culprits``; the verdicts it completes (none or one each)."""
        out = []
        for replica in culprits:
            steps = self._named.get(replica)
            if steps is None:
                if len(self._named) >= MAX_REPLICAS:
                    self._named.pop(next(iter(self._named)))
                steps = self._named[replica] = deque(maxlen=KEPT_STEPS)
            if step in steps:
                continue  # the same finding, told by another member
            steps.append(step)
            recent = sorted(s for s in steps if abs(step - s) <= self.window_steps)
            last = self._reported.get(replica)
            if len(recent) >= 2 and (last is None or step - last > self.window_steps):
                self._reported[replica] = step
                if len(self._reported) > MAX_REPLICAS:
                    self._reported.pop(next(iter(self._reported)))
                out.append(
                    Verdict(
                        culprit=Culprit(replica, node=node),
                        kind=SUSPECT_HARDWARE,
                        confidence=min(0.99, 0.5 + 0.2 * len(recent)),
                        evidence={"sdc_steps": recent, "window_steps": self.window_steps},
                    )
                )
        return out
