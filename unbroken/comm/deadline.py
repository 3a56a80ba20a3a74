"""How long to wait for an exchange before calling a peer hung, learned from what we saw.

A fixed timeout is either too long (PyTorch's 10 minutes stall every survivor) or too short
(false alarms on a busy machine). The deadline here is a multiple of the slowest recent
exchange, never below a floor; until enough exchanges have been seen, a generous initial value
applies (start-up, compilation and first allocations are slow).
"""

from __future__ import annotations

import dataclasses
from collections import deque


@dataclasses.dataclass
class LearnedDeadline:
    """Exchange deadline from observed exchange durations.

    Attributes:
        floor_s: the deadline never drops below this.
        factor: multiple of the slowest exchange in the window.
        initial_s: deadline before ``min_samples`` exchanges were observed.
        window: how many recent exchanges are remembered.
        min_samples: observations needed before the learned value applies.
    """

    floor_s: float = 0.5
    factor: float = 4.0
    initial_s: float = 30.0
    window: int = 50
    min_samples: int = 5

    def __post_init__(self) -> None:
        if not (
            0 < self.floor_s < float("inf") and 1 <= self.factor < float("inf") and 0 < self.initial_s < float("inf")
        ):
            raise ValueError("floor_s and initial_s must be > 0 and factor >= 1")
        self._seen: deque[float] = deque(maxlen=self.window)

    def observe(self, seconds: float) -> None:
        self._seen.append(seconds)

    def reset(self) -> None:
        """Forget history (after a membership change the exchange may be slower)."""
        self._seen.clear()

    @property
    def seconds(self) -> float:
        if len(self._seen) < self.min_samples:
            return self.initial_s
        return max(self.floor_s, self.factor * max(self._seen))
