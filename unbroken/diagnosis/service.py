"""The diagnosis master's shell inside the coordinator: telemetry in, ``verdict`` events out.

The rules are pure (:mod:`unbroken.diagnosis.master`); this adds what needs I/O: the clock,
the event log, and the stack of a hung rank. For a hang the culprit is sent ``SIGUSR1``
(its faulthandler writes every thread's stack to the file it named in its hello) and the
verdict is emitted once the stack is read, or after :attr:`STACK_WAIT_S` without it. A
SIGSTOPped process cannot answer until SIGCONT; the verdict then says so (``process_state``
``T`` from /proc) instead of carrying a stack.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

from unbroken.config import is_stack_signal
from unbroken.diagnosis.master import DiagnosisMaster
from unbroken.diagnosis.verdict import COMM_HANG, NONCOMM_HANG, Verdict
from unbroken.observe.events import EventLog

log = logging.getLogger(__name__)
DETECTOR = "unbroken.diagnosis"  # names the source in a verdict's evidence (the demo reports it)


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T for stopped...), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


class DiagnosisService:
    """Feeds the master and publishes its verdicts.

    Args:
        events: where ``verdict`` events go (the coordinator's log).
        locate: (replica, rank) -> (pid, stack_file) of a connected rank, or None.
    """

    STACK_WAIT_S = 0.3

    def __init__(self, events: EventLog, master: DiagnosisMaster | None = None) -> None:
        self.events = events
        self.master = master or DiagnosisMaster()
        self.latest: deque[dict[str, Any]] = deque(maxlen=20)
        self.ranks: dict[tuple[int, int], tuple[int, str]] = {}
        self.signals: dict[tuple[int, int], int] = {}

    def hello(self, replica: int, rank: int, pid: int, stack_file: str, stack_signal: object = None) -> None:
        self.ranks[(replica, rank)] = (pid, stack_file)
        # From the network: only a signal that asks for a dump, never one that ends the process.
        ok = type(stack_signal) is int and is_stack_signal(stack_signal)
        self.signals[(replica, rank)] = stack_signal if ok else signal.SIGUSR1  # type: ignore[assignment]

    def telemetry(self, replica: int, rank: int, node: str, msg: dict[str, Any]) -> None:
        self.master.ingest((replica, rank), node, msg, time.monotonic())

    def forget(self, replica: int) -> None:
        self.master.forget(replica)

    def tick(self) -> None:
        """Runs the rules; a bug in them must never stop the coordinator's own tick."""
        try:
            self._tick()
        except Exception:
            log.exception("diagnosis failed; training is unaffected")

    def _tick(self) -> None:
        for v in self.master.evaluate(time.monotonic()):
            if v.kind in (NONCOMM_HANG, COMM_HANG) and v.culprit.replica >= 0:
                asyncio.get_running_loop().create_task(self._with_stack(v))
            else:
                self._emit(v, {})

    async def _with_stack(self, v: Verdict) -> None:
        where = self.ranks.get((v.culprit.replica, v.culprit.rank or 0))
        extra: dict[str, Any] = {}
        if where is not None:
            pid, path = where
            state = process_state(pid)
            extra["process_state"] = state
            if state == "T":
                extra["stack"] = None
                extra["stack_note"] = "process is stopped (SIGSTOP): it cannot dump its stack until SIGCONT"
            elif state is not None and path:
                before = _size(path)
                try:
                    os.kill(pid, self.signals.get((v.culprit.replica, v.culprit.rank or 0), signal.SIGUSR1))
                except OSError as e:
                    extra["stack_note"] = f"could not signal pid {pid}: {e}"
                else:
                    deadline = time.monotonic() + self.STACK_WAIT_S
                    while time.monotonic() < deadline and _size(path) <= before:
                        await asyncio.sleep(0.02)
                    await asyncio.sleep(0.02)  # let the dump finish
                    extra["stack"] = _read_from(path, before)
        self._emit(v, extra)

    def _emit(self, v: Verdict, extra: dict[str, Any]) -> None:
        fields = v.fields()
        fields["evidence"] = {**fields["evidence"], **extra, "detector": DETECTOR}
        self.events.emit("verdict", **fields)
        self.latest.append({"t": time.time(), **fields})

    def status(self) -> list[dict[str, Any]]:
        return [{"t": e["t"], "culprit": e["culprit"], "class": e["class"], "confidence": e["confidence"]}
                for e in self.latest]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str | None:
    try:
        with open(path) as f:
            f.seek(offset)
            return f.read()[-8000:] or None
    except OSError:
        return None
