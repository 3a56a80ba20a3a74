"""ICCL's window monitor for one connection: slow only when data is waiting.

Throughput over the last ``window`` transfers is compared with its running mean. Low throughput
alone is not congestion (the connection may simply be idle between steps), so the monitor flags
only when throughput is below half the mean AND the bytes outstanding exceed twice the recent
maximum; it clears when throughput recovers to three quarters of the mean before the drop.
"""

from __future__ import annotations

from collections import deque


class WindowMonitor:
    """Per-connection throughput window (ICCL uses W=8)."""

    def __init__(self, window: int = 8, alpha: float = 0.05) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.alpha = alpha
        self._xfers: deque[tuple[int, float]] = deque(maxlen=window)
        self._outstanding: deque[int] = deque(maxlen=window)
        self.mean_bps: float | None = None
        self.flagged = False
        self._before_drop = 0.0

    @property
    def throughput_bps(self) -> float:
        secs = sum(s for _, s in self._xfers)
        return sum(b for b, _ in self._xfers) / secs if secs > 0 else 0.0

    def completed(self, nbytes: int, seconds: float, outstanding: int) -> bool:
        """Records one finished transfer; returns whether the connection is flagged now."""
        self._xfers.append((nbytes, max(seconds, 1e-9)))
        tput = self.throughput_bps
        recent_max = max(self._outstanding, default=0)
        self._outstanding.append(outstanding)
        if self.mean_bps is None:
            self.mean_bps = tput
        if self.flagged:
            if tput >= 0.75 * self._before_drop:
                self.flagged = False
        elif len(self._xfers) == self.window and tput < 0.5 * self.mean_bps and outstanding > 2 * recent_max:
            self.flagged = True
            self._before_drop = self.mean_bps
        if not self.flagged:
            self.mean_bps += self.alpha * (tput - self.mean_bps)
        return self.flagged
