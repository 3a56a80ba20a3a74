"""The worker's side of fault injection: a rank applies its own faults to its training.

:class:`WorkerChaos` is the :class:`~unbroken.train.hooks.FaultHook` that ``unbroken.init()``
installs in the :class:`~unbroken.train.manager.Manager` when the launcher planned worker-side
faults for this rank (:data:`~unbroken.faults.schedule.WORKER_KINDS`); they travel in the
:data:`~unbroken.config.ENV_CHAOS` environment variable (:func:`chaos_env`). With none planned
no hook is installed and the Manager pays nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from unbroken import config as env
from unbroken.faults.schedule import Fault, ScheduleError


def chaos_env(faults: Sequence[Fault], job_start: float) -> dict[str, str]:
    """The environment that hands ``faults`` to a worker (empty when there are none)."""
    if not faults:
        return {}
    return {env.ENV_CHAOS: json.dumps({"t0": job_start, "faults": [f.to_json() for f in faults]})}


class WorkerChaos:
    """Applies the worker-side faults of one rank; the Manager calls it at fixed points.

    Args:
        faults: this rank's worker faults.
        replica: this replica's id (a slow link delays only its own end).
        job_start: wall-clock time the job started, for ``at_s`` triggers.
        sleep: how to wait (tests pass a fake).
    """

    def __init__(self, faults: Sequence[Fault], replica: int, job_start: float, sleep: Any = time.sleep) -> None:
        self.faults = list(faults)
        self.replica = replica
        self.job_start = job_start
        self._sleep = sleep
        self._started: dict[int, tuple[float, int]] = {}  # fault index -> (wall time, step) it began
        self._step_t0: float | None = None
        self._slowed_step: int | None = None
        self.injected_s = 0.0

    @classmethod
    def from_env(cls, replica: int, environ: Mapping[str, str] | None = None) -> WorkerChaos | None:
        """The hook the launcher asked for, or None (no cost at all when no fault is planned)."""
        raw = env.chaos_spec(environ)
        if not raw:
            return None
        try:
            data = json.loads(raw)
            faults = [Fault.from_mapping(f, env.ENV_CHAOS) for f in data["faults"]]
            return cls(faults, replica, float(data["t0"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ScheduleError(f"{env.ENV_CHAOS} is malformed ({e}); it is set by `unbroken run`") from e

    def active(self, kind: str, step: int) -> list[Fault]:
        """The faults of ``kind`` in effect at ``step`` (now)."""
        now = time.time()
        out = []
        for i, f in enumerate(self.faults):
            if f.kind != kind:
                continue
            if i not in self._started:
                if not f.due(step, now - self.job_start):
                    continue
                self._started[i] = (now, step)
            began, first_step = self._started[i]
            if f.duration_s is not None and now - began > f.duration_s:
                continue
            if f.duration_s is None and kind == "nan_loss" and step != first_step:
                continue  # a NaN without a duration is one bad step

            out.append(f)
        return out

    def start_step(self, step: int) -> None:
        self._step_t0 = time.perf_counter()

    def before_exchange(self, step: int, members: Sequence[int], nbytes: int, grads: Sequence[Any] = ()) -> None:
        """Called after the quorum, before each exchange attempt of ``step``."""
        if self._step_t0 is not None and self._slowed_step != step:
            self._slowed_step = step
            compute = time.perf_counter() - self._step_t0
            for f in self.active("slow_rank", step):
                self._wait(((f.factor or 1.0) - 1.0) * compute)
        for f in self.active("slow_link", step):
            assert f.link is not None
            if all(r in members for r in f.link):
                self._wait(nbytes / ((f.mb_s or 1.0) * 1e6))
        for f in self.active("nan_loss", step):
            if f.poison_grads:
                for g in grads:
                    g.fill_(float("nan"))

    def loss(self, value: float, step: int) -> float:
        """The loss the training loop reports, NaN while a ``nan_loss`` fault is in effect."""
        return float("nan") if self.active("nan_loss", step) else value

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self.injected_s += seconds
            self._sleep(seconds)
