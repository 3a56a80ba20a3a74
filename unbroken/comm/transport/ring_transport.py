"""``UNBROKEN_EXCHANGE=ring``: unbroken's CPU-driven ring on each epoch's torch group.

Slower than the backend's all-reduce on CPU, but it times every connection
(:mod:`unbroken.comm.ring_allreduce`), so the diagnosis can name a slow link, and a link fault
(:mod:`unbroken.faults.link`) can be injected into it. One sum at a time, and sums only.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from unbroken.comm.recorder import FlightRecorder
from unbroken.comm.ring_allreduce import ring_allreduce_sum
from unbroken.comm.transport.backend_transport import BackendTransport
from unbroken.comm.transport.base import Running


class RingTransport(BackendTransport):
    """The ring's point-to-point sends on the group the backend transport builds."""

    name = "ring"
    overlaps = False
    gathers = False

    def start(
        self,
        pg: Any,
        tensor: torch.Tensor,
        rank: int,
        size: int,
        wake: threading.Event,
        op: Any,
        recorder: FlightRecorder | None,
    ) -> Running:
        if op is not None and op != dist.ReduceOp.SUM:
            raise ValueError("the ring exchange only sums")
        return RingRun(pg, tensor, rank, size, recorder, wake)


class RingRun:
    """The ring all-reduce on its own thread, behind the same done/wait surface as a future.

    Point-to-point works have no future to wake a bounded wait, so the ring runs on a daemon
    thread with the group's own timeout; a stuck ring is abandoned like a stuck backend op.
    """

    def __init__(
        self,
        pg: Any,
        tensor: torch.Tensor,
        rank: int,
        size: int,
        recorder: FlightRecorder | None,
        wake: threading.Event,
    ) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        seq = recorder.open.seq if recorder is not None and recorder.open else 0

        def run() -> None:
            try:
                ring_allreduce_sum(pg, tensor, rank, size, seq, lambda w: w.wait(), recorder)
            except BaseException as e:  # surfaces on the caller through wait()
                self._error = e
            finally:
                self._done.set()
                wake.set()

        threading.Thread(target=run, name="unbroken-ring", daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
