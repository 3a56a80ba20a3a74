"""The diagnosis master's shell inside the coordinator: telemetry in, ``verdict`` events out.

The rules are pure (:mod:`unbroken.diagnosis.master.master`); this adds what needs I/O: the clock,
the event log, and the stack of a hung rank. For a hang the verdict waits for the stack from
the rank's owner (the supervisor or node agent that started it, :mod:`unbroken.diagnosis.stacks`):
nothing here signals a process or reads a path, since whatever a connection says about its PID
or files is not to be trusted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from unbroken.diagnosis.master.master import DiagnosisMaster
from unbroken.diagnosis.rules.suspect import SuspectTracker
from unbroken.diagnosis.telemetry import SdcFound, TelemetryBatch
from unbroken.diagnosis.verdict import COMM_HANG, NONCOMM_HANG, Verdict
from unbroken.observe.events import EventLog

log = logging.getLogger(__name__)
DETECTOR = "unbroken.diagnosis"  # names the source in a verdict's evidence (the demo reports it)

# (replica, rank) -> evidence about its stack (see unbroken.diagnosis.stacks.dump).
StackSource = Callable[[int, int], Awaitable[dict[str, Any]]]


class DiagnosisService:
    """Feeds the master and publishes its verdicts.

    Args:
        events: where ``verdict`` events go (the coordinator's log).
        stacks: asks a hung rank's owner for its stack; None: verdicts carry no stack.
    """

    STACK_WAIT_S = 1.0  # the owner's own wait, plus a margin

    def __init__(
        self, events: EventLog, master: DiagnosisMaster | None = None, stacks: StackSource | None = None
    ) -> None:
        self.events = events
        self.master = master or DiagnosisMaster()
        self.stacks = stacks
        self.latest: deque[dict[str, Any]] = deque(maxlen=20)
        self.suspects = SuspectTracker()

    def telemetry(self, replica: int, rank: int, node: str, batch: TelemetryBatch) -> None:
        self.master.ingest((replica, rank), node, batch, time.monotonic())

    def sdc(self, found: list[SdcFound]) -> None:
        """Corruption a rank's exchange check found: a replica named again soon is a suspect."""
        for f in found:
            for v in self.suspects.observe(f.culprits, f.step):
                self._emit(v, {})

    def forget(self, replica: int) -> None:
        """The replica left (evicted or finished); a silent evictee is named by the next tick."""
        self.master.forget(replica, time.monotonic())

    def tick(self) -> None:
        """Runs the rules; a bug in them must never stop the coordinator's own tick."""
        try:
            self._tick()
        except Exception:
            log.exception("diagnosis failed; training is unaffected")

    def _tick(self) -> None:
        for v in self.master.evaluate(time.monotonic()):
            if v.kind in (NONCOMM_HANG, COMM_HANG) and v.culprit.replica >= 0 and self.stacks is not None:
                asyncio.get_running_loop().create_task(self._with_stack(v))
            else:
                self._emit(v, {})

    async def _with_stack(self, v: Verdict) -> None:
        assert self.stacks is not None
        try:
            extra = await asyncio.wait_for(self.stacks(v.culprit.replica, v.culprit.rank or 0), self.STACK_WAIT_S)
        except Exception as e:  # the verdict matters more than its stack
            extra = {"stack_note": f"no stack: {e!r}"}
        self._emit(v, extra)

    def _emit(self, v: Verdict, extra: dict[str, Any]) -> None:
        fields = v.fields()
        fields["evidence"] = {**fields["evidence"], **extra, "detector": DETECTOR}
        self.events.emit("verdict", **fields)
        self.latest.append({"t": time.time(), **fields})

    def status(self) -> list[dict[str, Any]]:
        return [
            {"t": e["t"], "culprit": e["culprit"], "class": e["class"], "confidence": e["confidence"]}
            for e in self.latest
        ]
