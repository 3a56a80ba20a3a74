"""torchft's process groups, mapped onto unbroken's cross-replica group.

In torchft a script builds the group that replicas all-reduce over (``ProcessGroupGloo``,
``ProcessGroupNCCL``, ``ProcessGroupBabyNCCL``) and hands it to the ``Manager``, which
reconfigures it at every quorum. In unbroken the Manager owns that group and rebuilds it per
quorum epoch, so these classes only say which backend to use (``gloo`` or ``nccl``, see
``unbroken run --cross-replica-backend``) and carry the timeout; they are never all-reduced on
directly.

:class:`ManagedProcessGroup` is the group a training loop all-reduces over, as torchtitan's
``replicate_pg``: ``dist.all_reduce(t, group=pg, op=AVG)`` inside FSDP's all-reduce hook, and
functional collectives (``funcol.all_reduce(t, "max", group=pg)``) for the loss, once
:meth:`ManagedProcessGroup.register` named it.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from unbroken.torchft.manager import Manager

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


class ProcessGroup(dist.ProcessGroup):
    """The backend the replicas exchange over; unbroken's Manager builds the group itself.

    ``backend``: what ``unbroken.init(cross_replica_backend=...)`` is given.
    """

    backend = "auto"

    def __init__(self, timeout: datetime.timedelta | float = DEFAULT_TIMEOUT, *args: Any, **kwargs: Any) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg, arg-type]  # torch's stub lacks the (rank, size) form
        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self._group_name: str | None = None

    @property
    def supports_reconfigure(self) -> bool:
        """torchft's Manager checks it; unbroken reconfigures every group it is given."""
        return True

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self.backend

    def errored(self) -> Exception | None:
        """Errors surface in unbroken's own exchange, never here."""
        return None

    def abort(self) -> None:
        """Nothing to abort: the Manager's group aborts its own epoch."""

    def shutdown(self) -> None:
        """Nothing to release: the Manager's shutdown releases its groups."""

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r})"


class ProcessGroupGloo(ProcessGroup):
    """Gloo across replicas (CPU tensors, or CUDA tensors carried by Gloo)."""

    backend = "gloo"


class ProcessGroupNCCL(ProcessGroup):
    """NCCL across replicas: each epoch's communicator is built eagerly and aborted when the
    epoch ends (:mod:`unbroken.comm.retire`)."""

    backend = "nccl"


class ProcessGroupBabyNCCL(ProcessGroupNCCL):
    """torchft runs NCCL in a subprocess so that a hung communicator can be killed; unbroken's
    epochs abort theirs on a watchdog thread instead, so this is :class:`ProcessGroupNCCL`."""


class ProcessGroupBabyGloo(ProcessGroupGloo):
    """As :class:`ProcessGroupBabyNCCL`, for Gloo."""


class ProcessGroupXCCL(ProcessGroup):
    """Not supported: unbroken's cross-replica backends are Gloo and NCCL."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("unbroken's cross-replica backends are gloo and nccl; XCCL is not supported")


ProcessGroupBabyXCCL = ProcessGroupXCCL


class FakeProcessGroupWrapper(ProcessGroup):
    """torchft's test wrapper: :meth:`report_future_error` fails the next all-reduce.

    Given to the Manager as its ``pg``; the Manager's next :meth:`~Manager.allreduce` of the
    step then reports the error (:meth:`take_future_error`), which vetoes the step, as the
    failed future of torchft's does.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg.timeout if isinstance(pg, ProcessGroup) else DEFAULT_TIMEOUT)
        self._pg = pg
        self.backend = pg.getBackendName() if isinstance(pg, ProcessGroup) else "auto"
        self._future_error: Exception | None = None

    def report_future_error(self, e: Exception) -> None:
        self._future_error = e

    def take_future_error(self) -> Exception | None:
        error, self._future_error = self._future_error, None
        return error


def backend_of(pg: Any) -> str | None:
    """What ``unbroken.init(cross_replica_backend=...)`` is given for the group a torchft
    script built; None keeps ``unbroken run``'s setting (any other group object)."""
    if isinstance(pg, ProcessGroup):
        return None if pg.backend == "auto" else pg.backend
    return None


def reduce_op_of(opts: Any) -> Any:
    """The ``dist.ReduceOp`` of an ``allreduce`` call's options (torch passes options; torchft's
    Manager also takes a bare op)."""
    if opts is None:
        return dist.ReduceOp.SUM
    if isinstance(opts, dist.AllreduceOptions):
        return opts.reduceOp
    return opts


class ManagedProcessGroup(ProcessGroup):
    """The replicas of the current quorum as a process group: each all-reduce is the
    Manager's (:meth:`Manager.allreduce <unbroken.torchft.manager.Manager.allreduce>`), its size
    the number of participating replicas. Errors never reach the caller: the Manager notes them
    and :meth:`Manager.should_commit` says no."""

    backend = "unbroken"

    def __init__(self, manager: Manager) -> None:
        super().__init__()
        self._manager = manager

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = reduce_op_of(opts)
        works = [self._manager.allreduce(t, reduce_op=op) for t in tensors]
        return works[0] if len(works) == 1 else _AllOf(works, tensors)

    def size(self) -> int:
        return max(1, self._manager.num_participants())

    def rank(self) -> int:
        return self._manager.participating_rank() or 0

    def register(self, name: str) -> dist.ProcessGroup:
        """Names this group for functional collectives and DeviceMesh (call once per name).

        As torchft does: a backend whose factory returns this group, and a one-rank group of
        it, so that ``funcol.all_reduce(t, op, group=pg)`` finds it by name. Needs the default
        process group (``dist.init_process_group``), as torchft's does.
        """
        group_name = f"{self.getBackendName()}:{name}"
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(group_name, lambda *args: self, devices=devices)
        return dist.new_group(
            ranks=[dist.get_rank()],
            backend=group_name,
            group_desc=group_name,
            timeout=datetime.timedelta(seconds=60),
        )

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch types it GroupName, a str
        if self._group_name is None:
            raise ValueError("ProcessGroup name not set: call register(name) first")
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def unregister(self) -> None:
        dist.destroy_process_group(self)


class _AllOf(dist.Work):
    """The works of a multi-tensor all-reduce, waited for together."""

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._works, self._tensors = works, tensors

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        self.wait()
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut
