"""The worker's side of fault injection: a rank applies its own faults to its training.

:class:`WorkerChaos` is the :class:`~unbroken.train.hooks.FaultHook` that ``unbroken.init()``
installs in the :class:`~unbroken.train.manager.Manager` when the launcher planned worker-side
faults for this rank (:data:`~unbroken.faults.schedule.WORKER_KINDS`); they travel in the
:data:`~unbroken.config.ENV_CHAOS` environment variable (:func:`chaos_env`). With none planned
no hook is installed and the Manager pays nothing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from unbroken import config as env
from unbroken.faults.bitflip import flip_bit, pick
from unbroken.faults.schedule import Fault, ScheduleError

log = logging.getLogger(__name__)


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
        self._state: Callable[[], Any] | None = None  # bind_state
        self._flipped: dict[int, int] = {}  # fault index -> the last step it flipped a bit in
        self.flips = 0  # bits flipped so far

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
            if f.duration_s is None and kind in ("nan_loss", "bitflip") and step != first_step:
                continue  # a NaN or a bit flip without a duration is one bad step

            out.append(f)
        return out

    def bind_state(self, state: Callable[[], Any]) -> None:
        """How to reach this rank's state (its state dicts), for flips in a weight or a moment."""
        self._state = state

    def start_step(self, step: int) -> None:
        self._step_t0 = time.perf_counter()
        if self._state is not None:
            for where in ("weight", "moment"):
                for i, f in self._bitflips(where, step):
                    self._flip(i, f, step, pick(self._state(), where))

    def after_exchange(self, step: int, buf: Any) -> None:
        """The exchange's sum ``buf`` as this member received it, before it is checked."""
        for i, f in self._bitflips("result", step):
            self._flip(i, f, step, buf)

    def _bitflips(self, where: str, step: int) -> list[tuple[int, Fault]]:
        """The bit flips at ``where`` due at ``step`` not yet applied in it (a redo of the step's
        exchange meets a one-step flip no more: a transient fault)."""
        due = {id(f) for f in self.active("bitflip", step)}
        return [
            (i, f)
            for i, f in enumerate(self.faults)
            if id(f) in due
            and f.where == where
            and self._flipped.get(i, -1) != step
            and (f.duration_s is not None or i not in self._flipped)
        ]

    def _flip(self, i: int, f: Fault, step: int, tensor: Any) -> None:
        flip_bit(tensor, f.index, f.bit)
        self._flipped[i] = step
        self.flips += 1
        log.warning("fault injected: bit %d of element %d of the %s flipped at step %d", f.bit, f.index, f.where, step)

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
        if grads:
            for i, f in self._bitflips("grad", step):
                self._flip(i, f, step, next((g for g in grads if g.numel() > 0), grads[0]))

    def loss(self, value: float, step: int) -> float:
        """The loss the training loop reports, NaN while a ``nan_loss`` fault is in effect."""
        return float("nan") if self.active("nan_loss", step) else value

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self.injected_s += seconds
            self._sleep(seconds)
