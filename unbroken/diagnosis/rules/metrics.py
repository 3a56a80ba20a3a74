"""Training-metric anomalies (TRANSOM's TEE): bad numbers caught like bad links.

Each replica's step metrics (loss, gradient norm, compute time, memory) are judged against
robust running statistics of its own history: non-finite values at once; a loss spike or a
gradient-norm explosion when the value lies many robust standard deviations above the median
AND a clear multiple of it (so a flat, noise-free history cannot raise alarms on tiny moves); a
step-time change point when the median of the recent window departs from the baseline window
and its fastest quarter departs too, both by the measured threshold of
:mod:`unbroken.diagnosis.rules.steptime` (a noisy neighbour makes steps bursty, a degraded rank makes
every step slower); memory growth when memory rises steadily over a long window.

What happens next is a policy: :data:`ACTIONS` per anomaly kind.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import numpy as np

from unbroken.diagnosis.robust import median, robust_z
from unbroken.diagnosis.rules.steptime import STEP_TIME_THRESHOLD, median_ratio, shift_score

SKIP, ROLLBACK, ISOLATE, NONE = "skip_step", "rollback", "isolate", "none"
ACTIONS = (SKIP, ROLLBACK, ISOLATE, NONE)
DEFAULT_POLICY: dict[str, str] = {
    "nonfinite_loss": SKIP,
    "nonfinite_grad": SKIP,
    "loss_spike": SKIP,
    "grad_explosion": SKIP,
    "step_time_change": NONE,
    "memory_growth": ISOLATE,
}


def parse_policy(spec: str) -> dict[str, str]:
    """``"loss_spike=rollback,memory_growth=none"`` over the default policy."""
    policy = dict(DEFAULT_POLICY)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, sep, action = item.partition("=")
        if not sep or kind not in DEFAULT_POLICY or action not in ACTIONS:
            raise ValueError(
                f"bad anomaly policy entry {item!r}: write KIND=ACTION with KIND in "
                f"{sorted(DEFAULT_POLICY)} and ACTION in {list(ACTIONS)}"
            )
        policy[kind] = action
    return policy


@dataclasses.dataclass(frozen=True)
class Anomaly:
    kind: str
    step: int
    value: float
    evidence: dict[str, Any]


@dataclasses.dataclass
class MetricDetector:
    """One replica's metric history and the rules that judge each new step.

    Attributes:
        history: steps kept for the running statistics.
        min_history: steps needed before spikes or change points are judged.
        spike_z: robust z-score above which a value is a spike...
        spike_ratio: ...if it is also this multiple of the median.
        change_window: recent steps whose median is compared with the baseline.
        change_threshold: the recent window's median and fastest quarter must both be this
            multiple of the baseline's for a change point (:func:`steptime.shift_score`; the
            value is measured, see :data:`steptime.STEP_TIME_THRESHOLD`).
        memory_window: steps over which memory growth is judged.
        memory_growth: relative growth over that window that is an anomaly.
        memory_after_steps: training steps a rank reports before its memory samples count. Memory
            rises steadily while a process warms up (imports, the model, the optimizer state made
            at its first step): a 2-rank Llama replica on a busy machine spent 34 s between
            connecting and its first step, long enough to fill the window with a clean rise and
            get every replica isolated for memory_growth.
    """

    history: int = 64
    min_history: int = 16
    spike_z: float = 8.0
    spike_ratio: float = 1.5
    grad_ratio: float = 4.0
    change_window: int = 8
    change_threshold: float = STEP_TIME_THRESHOLD
    memory_window: int = 50
    memory_growth: float = 0.2
    memory_after_steps: int = 20

    def __post_init__(self) -> None:
        self.loss: deque[float] = deque(maxlen=self.history)
        self.grad: deque[float] = deque(maxlen=self.history)
        self.compute: deque[float] = deque(maxlen=self.history)
        self.memory: deque[float] = deque(maxlen=self.memory_window)
        self.steps_seen = 0

    def observe(
        self,
        step: int,
        loss: float | None = None,
        grad_norm: float | None = None,
        compute_s: float | None = None,
        memory: float | None = None,
    ) -> list[Anomaly]:
        """Judges one step; healthy values join the history, anomalous ones do not."""
        out: list[Anomaly] = []
        if step >= 0:
            self.steps_seen += 1
        if loss is not None:
            out += self._value("loss", step, loss, self.loss, self.spike_ratio)
        if grad_norm is not None:
            out += self._value("grad", step, grad_norm, self.grad, self.grad_ratio)
        if compute_s is not None:
            self.compute.append(compute_s)
            xs = list(self.compute)
            shift = shift_score(xs, self.change_window, self.min_history)
            if shift is not None and shift >= self.change_threshold:
                ratio = median_ratio(xs, self.change_window, self.min_history) or shift
                evidence = {"recent_over_baseline": round(ratio, 3), "shift_score": round(shift, 3)}
                out.append(Anomaly("step_time_change", step, ratio, evidence))
        if memory is not None and self.steps_seen >= self.memory_after_steps:
            self.memory.append(memory)
            growth = self.memory_trend()
            if growth is not None and growth >= self.memory_growth:
                out.append(
                    Anomaly(
                        "memory_growth",
                        step,
                        growth,
                        {"relative_growth": round(growth, 3), "window_steps": self.memory_window},
                    )
                )
        return out

    def _value(self, name: str, step: int, x: float, hist: deque[float], ratio: float) -> list[Anomaly]:
        if not math.isfinite(x):
            return [Anomaly(f"nonfinite_{name}", step, x, {name: str(x)})]
        if len(hist) >= self.min_history:
            z = robust_z(x, hist)
            m = median(hist)
            if z >= self.spike_z and x >= ratio * m:
                kind = "loss_spike" if name == "loss" else "grad_explosion"
                return [Anomaly(kind, step, x, {name: x, "median": m, "robust_z": round(z, 1)})]
        hist.append(x)
        return []

    def change_point(self) -> float | None:
        """Recent-window median over the baseline median, once both windows are full."""
        return median_ratio(list(self.compute), self.change_window, self.min_history)

    def memory_trend(self) -> float | None:
        """Relative growth over the window if memory rose steadily (a fitted line, r^2 >= 0.8)."""
        if len(self.memory) < self.memory_window:
            return None
        y = np.asarray(self.memory, dtype=float)
        x = np.arange(len(y), dtype=float)
        slope, intercept = np.polyfit(x, y, 1)
        fit = slope * x + intercept
        ss_res = float(((y - fit) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum())
        if ss_tot == 0 or 1 - ss_res / ss_tot < 0.8 or y[0] <= 0:
            return None
        return float(slope * (len(y) - 1) / y[0])


def wants_skip(loss: float | None, grad_norm: float | None, policy: dict[str, str]) -> str | None:
    """On the worker, before the exchange: the anomaly that makes this step's gradient unusable.

    Only what can be judged from one step without history (non-finite values): it must be
    decided before the gradient is averaged into every replica.
    """
    if loss is not None and not math.isfinite(loss) and policy.get("nonfinite_loss") == SKIP:
        return "nonfinite_loss"
    if grad_norm is not None and not math.isfinite(grad_norm) and policy.get("nonfinite_grad") == SKIP:
        return "nonfinite_grad"
    return None
