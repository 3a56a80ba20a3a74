"""What every cross-replica transport provides (:mod:`unbroken.comm.transport`)."""

from __future__ import annotations

import dataclasses
import datetime
import threading
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.distributed as dist

from unbroken.comm.recorder import FlightRecorder
from unbroken.comm.retire import GroupReaper
from unbroken.wire.auth import JobSecret


class Running(Protocol):
    """A started sum: what the group waits on, and what the reaper holds until it is over."""

    def done(self) -> bool: ...

    def wait(self) -> Any: ...


@dataclasses.dataclass
class EpochLink:
    """What a transport builds one epoch's link from, on the epoch's build thread."""

    store: Any  # the epoch's prefix of the job's authenticated store: its rendezvous
    store_address: str  # HOST:PORT of that store
    rank: int
    size: int
    device: torch.device
    tag_epoch: str  # ``TAG/epochN``: names the epoch's connections
    secret: JobSecret
    backend_setting: str  # ``auto``, ``nccl`` or ``gloo`` (unbroken.comm.backend)
    timeout: datetime.timedelta  # the backend's own timeout
    rendezvous_s: float
    reaper: GroupReaper


class Transport(ABC):
    """One way of carrying an epoch's sum: builds the link, starts sums on it, releases it."""

    name = ""  # its UNBROKEN_EXCHANGE value
    overlaps = True  # whether several sums may be in flight at once (a bucket each)
    gathers = False  # whether start_gather is the backend's all-gather (else a sum of the rows)

    @abstractmethod
    def build(self, link: EpochLink) -> tuple[str, Any]:
        """The epoch's link and the name of its backend; runs on the epoch's build thread."""

    @abstractmethod
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
        """Starts summing ``tensor`` in place (or ``op``); ``wake`` is set when it is over."""

    def start_overlapped(self, pg: Any, tensor: torch.Tensor) -> Held:
        """Starts one of several sums in flight at once (only where :attr:`overlaps`)."""
        return allreduce(pg, tensor, None)

    def start_gather(self, pg: Any, tensor: torch.Tensor, rank: int, size: int) -> Held:
        """Starts filling ``tensor``, ``size`` equal rows of which only row ``rank`` is this
        member's (the others zero), with every member's row (only where :attr:`overlaps`).

        That is the rows' sum, which a transport without an all-gather computes; the backend's
        all-gather moves each row once instead of summing them around the ring: on 2 cores, a
        3-member Gloo all-reduce of 42 floats took 1.2 ms of CPU and 2.7 ms, the all-gather
        0.9 and 1.9 ms (2 members: 1.1 and 1.8 ms, against 0.3 and 0.5 ms).
        """
        if not self.gathers:
            return allreduce(pg, tensor, None)
        rows = list(tensor.chunk(size))
        work = pg.allgather([rows], [rows[rank].clone()])
        return Held(work, work.get_future())

    def release(self, reaper: GroupReaper, pg: Any, backend: str, epoch: int | None, works: list[Any]) -> None:
        """Lets go of a link no longer used: the reaper releases it once ``works`` are over."""
        reaper.retire(pg, backend, epoch, works)


class Held:
    """A backend operation and its future, kept together until it is over: the reaper holds both
    until then, so that neither a running Gloo work nor its tensors are freed under it."""

    __slots__ = ("future", "work")

    def __init__(self, work: Any, future: Any) -> None:
        self.work, self.future = work, future

    def done(self) -> bool:
        return bool(self.future.done())

    def wait(self) -> Any:
        return self.future.wait()


def allreduce(pg: Any, tensor: torch.Tensor, op: Any) -> Held:
    """Starts the all-reduce of ``pg`` on ``tensor`` (a sum unless ``op`` says otherwise)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM if op is None else op  # type: ignore[assignment]  # torch's stub: RedOpType converts to ReduceOp
    work = pg.allreduce([tensor], opts)
    return Held(work, work.get_future())
