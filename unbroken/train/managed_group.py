"""A ``torch.distributed`` process group whose all-reduce is the fault-tolerant exchange.

``manager.process_group()`` returns one. Wherever torch takes a group for an all-reduce of
gradients it works, notably FSDP2's all-reduce hook, the torchtitan HSDP pattern: ``fully_shard``
over the ranks of one replica, and across replicas::

    pg = manager.process_group()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(lambda t: dist.all_reduce(t, group=pg, op=dist.ReduceOp.AVG))
    loss.backward()                      # each shard averaged across replicas as FSDP reduces it
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if manager.sync_gradients([p.grad for p in model.parameters()]):   # or unbroken.Optimizer
        optimizer.step(); manager.commit()

Each all-reduce is an exchange of this step (with the step's metadata, bounded waits and the
coordinator's abort); ``AVG`` divides by the replicas that contributed. Failures are never
raised into the backward pass: the tensor keeps its local value, the rest of the step's
all-reduces do nothing, and :meth:`Manager.sync_gradients` returns False (the optimizer must not
step; the next attempt of the step asks for a quorum without the failed epoch). In a step in
which a replica catches up, the all-reduces do nothing and ``sync_gradients`` averages the
gradients it is given, as :meth:`Manager.allreduce` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from unbroken.train.interface import BucketExchange
from unbroken.train.step.overlap import METADATA


class ManagedProcessGroup(dist.ProcessGroup):
    """The replicas of the current quorum as a process group (``allreduce`` only)."""

    def __init__(self, manager: BucketExchange) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg, arg-type]  # torch's stub lacks the (rank, size) form
        self.manager = manager

    def size(self) -> int:
        d = self.manager.decision
        return len(d.members) if d is not None else 1

    def rank(self) -> int:
        d = self.manager.decision
        return d.members.index(self.manager.config.replica_id) if d is not None else 0

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "unbroken"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        if op == dist.ReduceOp.AVG:
            avg = True
        elif op == dist.ReduceOp.SUM:
            avg = False
        else:
            raise ValueError("the fault-tolerant group reduces gradients: use ReduceOp.SUM or ReduceOp.AVG")
        o = self.manager.begin_overlap()
        if o.decision is None or o.failed:
            return _Done(tensors)
        bufs = []
        for t in tensors:
            n = t.numel()
            buf = torch.empty(n + METADATA, dtype=torch.float32, device=t.device)
            buf[:n].copy_(t.reshape(-1))
            self.manager.start_bucket(buf)
            bufs.append(buf)
        return _Exchange(self.manager, tensors, bufs, avg)


class _Done(dist.Work):
    """A work with nothing left to do."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


class _Exchange(_Done):
    """Waits for its sums, checks them, and writes the sum or average into the tensors."""

    def __init__(
        self, manager: BucketExchange, tensors: list[torch.Tensor], bufs: list[torch.Tensor], avg: bool
    ) -> None:
        super().__init__(tensors)
        self._manager, self._bufs, self._avg = manager, bufs, avg
        self._waited = False

    def wait(self, timeout: Any = None) -> bool:
        if self._waited:
            return True
        self._waited = True
        if not self._manager.wait_buckets(last=False):
            return True  # sync_gradients reports the failure; the backward pass goes on
        contributing = self._manager.begin_overlap().contributing
        if contributing == 0:
            return True  # every replica sat the step out: sync_gradients says so
        scale = 1.0 / contributing if self._avg else 1.0
        for t, buf in zip(self._tensors, self._bufs, strict=False):
            # In place: a temporary of the product cost 3 ms of CPU a step on the Llama example's
            # shards (a fresh multi-MB allocation each time), against 0.5 ms this way.
            torch.mul(buf[: t.numel()].view_as(t), scale, out=t)
        return True

    def is_completed(self) -> bool:
        return self._waited

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        self.wait()
        return super().get_future()
